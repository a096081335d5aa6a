"""Host storage of every unit's training state behind `streamer.store.interface`'s `StoreReader` and
`StoreWriter` (their call orders are written there): RAM slabs and chunk-interleaved files, journaled per-step
commits."""
