"""Checkpoints: atomic directories with a manifest (store), and whole-run state (run_state)."""

from rl_core.checkpoint.resume import (check_checkpoint_matches, check_model_matches, check_run_checkpoint,
                                       choose_resume, peek_resume, set_aside_newer,
                                       validate_resume_from)
from rl_core.checkpoint.run_state import LoadedCheckpoint, load_run_checkpoint, save_run_checkpoint
from rl_core.checkpoint.store import (
    MANIFEST,
    is_complete,
    newest_complete,
    prune,
    read_manifest,
    verify_checkpoint,
    write_checkpoint,
)

__all__ = ["check_checkpoint_matches", "check_model_matches", "check_run_checkpoint", "choose_resume",
           "peek_resume", "set_aside_newer", "validate_resume_from", "LoadedCheckpoint", "MANIFEST", "is_complete", "load_run_checkpoint", "newest_complete", "prune",
           "read_manifest", "save_run_checkpoint", "verify_checkpoint", "write_checkpoint"]
