"""Host storage of every unit's training state: layouts, RAM and file slabs, journaled per-step commits."""
