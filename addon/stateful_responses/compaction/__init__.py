"""Compaction provided where the upstream lacks it: ``/responses/compact``,
Codex's ``compaction_trigger``, and the proxy's own sealed compaction items
(docs/compaction.md)."""
