"""The on-disk format as pure math and schemas: no I/O here."""

from engramdb.layouts.geometry import (
    HUGE_PAGE,
    PAGE,
    TableGeometry,
    badge_rows_for,
    plan_geometry,
)

__all__ = ["HUGE_PAGE", "PAGE", "TableGeometry", "badge_rows_for", "plan_geometry"]
