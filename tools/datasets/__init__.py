"""Builders of real development sets (docs/architecture.md, "Tools")."""
