"""Pipeline parallelism: schedules as data (``schedules``); the runtime, the
partitioner and the simulator build on them."""

from mindpipe_jax.parallel.pipeline.schedules import (
    DEFAULT_COST,
    SCHEDULES,
    Kind,
    Schedule,
    ScheduleError,
    ScheduleReport,
    Task,
    Timeline,
    afapab,
    from_orders,
    get_schedule,
    gpipe,
    interleaved,
    interleaved_placement,
    one_f_one_b,
    register_schedule,
    validate,
    zb_h1,
)

__all__ = ["DEFAULT_COST", "SCHEDULES", "Kind", "Schedule", "ScheduleError", "ScheduleReport", "Task",
           "Timeline", "afapab", "from_orders", "get_schedule", "gpipe", "interleaved",
           "interleaved_placement", "one_f_one_b", "register_schedule", "validate", "zb_h1"]
