"""The documentation's tools: the generated reference pages, the site build's link hook."""
