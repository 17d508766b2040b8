"""Partitioning a model into pipeline stages: measured costs (``profile``), the memory
model (``memory``), the search (``search``, ``partition``) and its result (``result``)."""
