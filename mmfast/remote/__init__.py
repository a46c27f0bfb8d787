"""The streaming client, one layer above ``mmfast.util``: remote objects (``objects``: which paths are remote,
verified whole-object downloads, shard patterns), how a failed read is told and shown (``errors``: transient or
permanent, URLs without credentials), one plain HTTP(S) GET (``http_get``) and the bounded shared cache of
remote shards (``shard_cache``). Imports only ``mmfast.util``; fsspec only when a store is read through it."""
