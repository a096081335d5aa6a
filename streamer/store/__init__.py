"""Host storage of every unit's training state behind `streamer.store.interface.Store` (its call order is
written there): RAM slabs and chunk-interleaved files, journaled per-step commits."""
