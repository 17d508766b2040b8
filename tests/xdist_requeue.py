"""A worker crash must not hang the test run (pytest-xdist 3.x, ``--dist loadgroup``).

When a worker dies (XLA aborts the process on a collective that times out), xdist's
scope scheduler puts the dead worker's work units back in the queue, the finished ones
included. The replacement worker is then handed units with nothing left to run and
the controller waits for them forever: the suite never ends (CI stopped at its 90
minutes with one crashed test). Here only what the dead worker had not run goes back,
less the test that was running when it died, which xdist reports as failed.

A replacement worker is in the scheduler from its start but has no collection until it
has collected; a reschedule of every worker in that window (another worker died, or
finished collecting) must pass it by, or the controller stops on a KeyError. It gets
its first work when its own collection arrives. A worker that died right after its last
report is sent nothing either (the send fails): its end puts the work back.
"""

from __future__ import annotations


def _requeue_unfinished(self, node):
    """``LoadScopeScheduling.remove_node``: the test that crashed (None when the worker
    had nothing left), its unfinished work back in the queue, the other workers fed."""
    workload = self.assigned_work.pop(node)
    pending = [nodeid for unit in workload.values() for nodeid, done in unit.items() if not done]
    if not pending:
        return None
    crashed = pending[0]  # xdist runs a unit's tests in order: the first unfinished one
    for scope, unit in workload.items():
        left = {nodeid: done or nodeid == crashed for nodeid, done in unit.items()}
        if not all(left.values()):
            self.workqueue[scope] = left
    for other in self.assigned_work:
        self._reschedule(other)
    return crashed


def _reschedule_collected(self, node):
    """``LoadScopeScheduling._reschedule``, passing by a worker still collecting, and one
    that died after reporting its last test but before the controller saw it go: sending
    it more work fails (``OSError``, the channel closed) and stopped the controller. The
    unit just assigned to it stays in its workload, which ``remove_node`` puts back when
    the worker's end arrives."""
    if node not in self.registered_collections:
        return
    try:
        _RESCHEDULE[0](self, node)
    except OSError:
        pass


_RESCHEDULE = []  # the scheduler's own _reschedule, kept at install


def install(config) -> None:
    """Patch the controller's scheduler (workers schedule nothing)."""
    if hasattr(config, "workerinput"):
        return
    try:
        import xdist
        from xdist.scheduler.loadscope import LoadScopeScheduling
    except ImportError:
        return
    if xdist.__version__.split(".")[0] == "3":  # the scheduler this replaces
        LoadScopeScheduling.remove_node = _requeue_unfinished
        if not _RESCHEDULE:
            _RESCHEDULE.append(LoadScopeScheduling._reschedule)
            LoadScopeScheduling._reschedule = _reschedule_collected
