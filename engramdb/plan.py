"""Moved to `engramdb.read.plan` (this re-export goes once every importer has moved)."""

from engramdb.read.plan import *  # noqa: F403
from engramdb.read.plan import Geometry, GeometryLike, ReadPlan, assemble, locate, plan_reads

__all__ = ["Geometry", "GeometryLike", "ReadPlan", "assemble", "locate", "plan_reads"]
