"""Pictures of what the library plans, for a person who would rather look than read.

``draw_schedule`` draws a pipeline schedule table as a timeline: one row per
stage (stage 0 on top), time left to right, one box per task coloured by kind
(F blue, B orange, BW red, W green; with ``v > 1`` chunks, a later chunk is a
darker shade of its kind), the microbatch number in each box that has room for it,
and idle time (the bubble) as light grey hatching. ``schedule_summary`` is the
same information as text (what ``mindpipe schedule`` prints).

matplotlib is imported only inside the drawing functions (it is in the ``plots``
and ``dev`` extras), and only through its object-oriented API with the Agg
canvas: no pyplot, no global backend switch, so drawing from a notebook or a
headless test leaves the caller's matplotlib state alone.

The code lives in three sibling modules, re-exported here: ``viz_schedule``
(``draw_schedule``, ``schedule_summary``), ``viz_plots`` (``draw_plan``,
``draw_lanes``, ``draw_landscape``) and ``viz_common`` (what they share: the
picture formats, the colours, ``require_matplotlib``, ``check_picture_path``).
"""

from __future__ import annotations

from mindpipe_jax.viz_common import KIND_COLORS, PICTURE_FORMATS, check_picture_path, require_matplotlib
from mindpipe_jax.viz_plots import draw_landscape, draw_lanes, draw_plan
from mindpipe_jax.viz_schedule import draw_schedule, schedule_summary

__all__ = ["draw_schedule", "draw_plan", "draw_lanes", "draw_landscape", "schedule_summary",
           "check_picture_path",
           "require_matplotlib",
           "PICTURE_FORMATS", "KIND_COLORS"]
