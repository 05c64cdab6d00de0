"""Collectors: turn raw engine output (/metrics, per-request metrics, per-step plugin stats) into
typed records. No policy logic and no storage here: records go to a sink (see ``records``)."""
