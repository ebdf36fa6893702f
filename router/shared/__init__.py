"""What the router replicas share through Redis besides the index: their in-flight load (``load``:
this replica's, ``shared_load``: its copy in Redis and the others' totals). The rooms import
downwards: prompts, shared, routing, upstream, http, observe (tests/unit/test_imports.py)."""
