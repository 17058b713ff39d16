"""The steps a launch re-runs that the last launch's log shows committed, and why, in words.

Pure: the manager's checkpoint dir (``manager/checkpoints``) decides it as a
launch starts and logs it; the end summary on the command line reads it from
the log and says it the same way.
"""

from __future__ import annotations

from typing import Any

from undying.checkpoint.manifest import step_dirname

__all__ = ["relaunch_rerun", "rerun_words"]


def relaunch_rerun(resume_step: int, committed: int, saved: int, rejected: list[str],
                   where: str) -> dict[str, Any] | None:
    """The steps a launch re-runs that the last launch's log shows committed, and why; None for
    none.

    ``resume_step``: where this launch starts after (0: step 1); ``committed``
    and ``saved``: the newest step the last launch committed and the newest it
    checkpointed; ``rejected``: the names discovery skipped now.
    """
    if committed <= resume_step:
        return None
    if saved > resume_step and step_dirname(saved) in rejected:
        why = f"the last launch's checkpoint of step {saved} was rejected (said above)"
    elif saved > resume_step:
        why = (f"the last launch's checkpoint of step {saved} is gone from {where} (deleted or "
               "moved)")
    else:
        why = "the last launch committed them after its newest checkpoint" + (
            f" (step {saved})" if saved > 0 else " (it saved none)")
    return {"first": resume_step + 1, "last": committed, "steps": committed - resume_step,
            "why": why}


def rerun_words(rerun: dict[str, Any]) -> str:
    """``relaunch_rerun``'s answer in words: for the resume line and the end summary."""
    first, last = int(rerun["first"]), int(rerun["last"])
    span = f"step {first}" if first == last else f"steps {first}..{last}"
    return (f"re-runs {int(rerun['steps'])} step(s) ({span}) the last launch committed: "
            f"{rerun['why']}")
