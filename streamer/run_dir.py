"""A run's folder (`RunDir`): what it holds, how it is created, opened and continued.

    config.toml        the resolved RunConfig; `streamer train --config RUN/config.toml --run-dir NEW` repeats it
    store/             the host store: weights, fp32 master, Adam moments, gradients (docs/STORE.md)
    tokenizer/         tokenizer.json and the two files transformers reads beside it
    metrics.jsonl      one JSON object per optimizer step and per evaluation
    trace.json         the memory trace of the latest session; trace.chrome.json, memory.png: its views
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memory_model.trace import Trace
from streamer.config import TrainerConfig
from streamer.run import RunConfig, RunError, blame, read_toml
from streamer.errors import StoreError
from streamer.io.tokenizer import Tokenizer, load_tokenizer
from streamer.store.commit import kept_steps, lock_file, read_journal, read_kept, read_manifest
from streamer.store import ranks
from streamer.store.slabfile import checksum_of, open_for_writing, refuse_link, replace_file, write_json_atomic

# In a run folder from its creation until config.toml is written: a rerun clears such a folder and sets up
# again, if it holds nothing but what set-up writes.
SETUP_MARK = "setup.incomplete"
_SETUP_FILES = {SETUP_MARK, "tokenizer", "store", "config.toml.tmp"}
_SETUP_LOCKS: dict[Path, int] = {}  # run folder -> this process's locked descriptor of its SETUP_MARK
_CHECKSUM_LINE = "# checksum (xxh3-64 of the lines above): "  # config.toml's last line


@dataclass(frozen=True)
class RunDir:
    """A run's folder and the names of what it holds (see the module docstring)."""

    root: Path

    @property
    def config(self) -> Path:
        return self.root / "config.toml"

    @property
    def store(self) -> Path:
        return self.root / "store"

    @property
    def tokenizer(self) -> Path:
        return self.root / "tokenizer"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def trace_json(self) -> Path:
        return self.root / "trace.json"

    @property
    def trace_chrome(self) -> Path:
        return self.root / "trace.chrome.json"

    @property
    def plot(self) -> Path:
        return self.root / "memory.png"

    def processes(self) -> int:
        """How many data-parallel processes trained the run: each keeps its own store in store/rank<N>."""
        return ranks.processes(self.store)

    def store_to_read(self) -> Path:
        """A store with the run's weights: every process's store holds the same ones, unless the state is sharded
        (then the folder of every rank's slice, which one process reads as one store)."""
        if self.processes() == 1 or ranks.is_sharded(self.store):
            return self.store
        return ranks.rank_dir(self.store, 0)

    @staticmethod
    def is_run(path: str | Path) -> bool:
        return (Path(path) / "config.toml").is_file()

    @classmethod
    def create(cls, path: str | Path) -> RunDir:
        """A new run in `path`, which must not exist, be empty, or hold a set-up that was killed part-way (its
        SETUP_MARK, no config.toml, nothing but set-up files), which is cleared. Nothing else is ever overwritten.
        The mark stays, locked by this process, until `finish_setup`."""
        root = Path(path)
        if root.exists() and not root.is_dir():
            raise RunError(f"--run-dir {root} is a file; choose a folder name for the run")
        if cls.is_run(root):
            raise RunError(f"{root} already holds a run; continue it with `streamer train --resume {root}` "
                           "or choose a new --run-dir")
        entries = {p.name for p in root.iterdir()} if root.is_dir() else set()
        if entries and not (SETUP_MARK in entries and entries <= _SETUP_FILES):
            raise RunError(f"{root} exists and is not a run directory; it is never overwritten: choose a new --run-dir")
        busy = RunError(f"{root} is being set up by another process; wait for it to finish or choose another --run-dir")
        try:
            root.mkdir(parents=True, exist_ok=True)
            _SETUP_LOCKS[root] = lock_file(root / SETUP_MARK, busy)
        except OSError as exc:
            raise RunError(f"cannot create the run directory {root} ({exc.strerror}); "
                           "choose another --run-dir") from None
        for name in entries - {SETUP_MARK}:  # the mark stays: a kill while clearing leaves a set-up still known
            path = root / name
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        return cls(root)

    def finish_setup(self) -> None:
        """config.toml is in place: the run exists, and the set-up mark (if a kill left one) can go."""
        (self.root / SETUP_MARK).unlink(missing_ok=True)
        fd = _SETUP_LOCKS.pop(self.root, None)
        if fd is not None:
            os.close(fd)

    @classmethod
    def open(cls, path: str | Path) -> RunDir:
        root = Path(path)
        if not cls.is_run(root):
            raise RunError(f"{root} is not a run directory (no config.toml); pass a folder `streamer train` made")
        return cls(root)

    def read_config(self) -> RunConfig:
        """The run's settings, once config.toml's checksum line says they are the ones the run wrote (a file
        from before the line was written has none)."""
        try:
            text = self.config.read_text(encoding="utf-8-sig")
        except (OSError, UnicodeDecodeError) as exc:
            raise RunError(f"cannot read {self.config} ({exc}); restore it from a backup") from None
        body, _, last = text.rstrip("\n").rpartition("\n")
        if last.startswith(_CHECKSUM_LINE) and last != _CHECKSUM_LINE + _hex(checksum_of(body + "\n")):
            raise RunError(f"{self.config} is damaged or was edited (its checksum does not match its settings); "
                           "restore it from a backup, and change a resumable setting with its flag instead "
                           f"(`streamer train --resume {self.root} --steps N`)")
        values = read_toml(self.config)
        with blame(self.config, set(values)):
            return RunConfig.of(values)

    def write_config(self, cfg: RunConfig) -> None:
        # Atomic: a run is a run once its whole config is there. Its own paths relative: a copy is the copy's.
        body = cfg.to_toml(self.root)
        sealed = body + _CHECKSUM_LINE + _hex(checksum_of(body)) + "\n"
        replace_file(self.config, lambda tmp: tmp.write_text(sealed, encoding="utf-8"))

    def refuse_links(self) -> None:
        """Before a run is continued: a file in its folder that is a symbolic link is refused (a LinkRefused), before
        a step trains rather than when the write comes (`open_for_writing`, `replace_file`, which guard the files
        of a folder that is itself a link, not walked here)."""
        for folder, _, files in os.walk(self.root):
            for name in files:
                refuse_link(Path(folder) / name)

    def tokenizer_checksum(self) -> int:
        """The xxh3-64 of the tokenizer folder's files and their names. `Session.train` commits it with each step, so
        a changed or damaged file is found before it tokenizes anything (`load_tokenizer`)."""
        parts = []
        for path in sorted(p for p in self.tokenizer.rglob("*") if p.is_file()):
            name, data = str(path.relative_to(self.tokenizer)).encode(), path.read_bytes()
            parts += [len(name).to_bytes(8, "little"), name, len(data).to_bytes(8, "little"), data]
        return checksum_of(b"".join(parts))

    def load_tokenizer(self) -> Tokenizer:
        """The run's tokenizer, once its files are those its store's last commit recorded (a kept step's where the
        manifest cannot be read; a run from before the record has none to check)."""
        root, recorded = ranks.every_store(self.store)[0], None
        for step in [None, *reversed(kept_steps(root))]:
            try:
                record = read_manifest(root) if step is None else read_kept(root, step)
            except StoreError:
                continue  # opening the store says what is damaged (or goes back to a kept step)
            recorded = record["trainer"].get("extra", {}).get("tokenizer")
            break
        if recorded is not None and recorded != self.tokenizer_checksum():
            raise RunError(f"{self.tokenizer} is damaged or was changed (its files are not those the run was trained "
                           "with); restore it from a backup, or start a new run")
        return load_tokenizer(self.tokenizer)

    @property
    def reference(self) -> Path:
        """--method dpo: each pair's reference log-probabilities, computed before step 1."""
        return self.root / "reference.json"

    def write_reference(self, values: dict[str, Any]) -> None:
        """The reference log-probabilities (by data: train, held_out), with a checksum of their text."""
        _write_sealed(self.reference, values)

    def read_reference(self) -> dict[str, Any]:
        """The reference log-probabilities `write_reference` kept, once their checksum says they are."""
        return _read_sealed(self.reference, "the reference log-probabilities of this DPO run")

    @property
    def source_config(self) -> Path:
        """The --from-pretrained folder's config.json, as the user's file had it."""
        return self.root / "source_config.json"

    def write_source_config(self, values: dict[str, Any]) -> None:
        """The checkpoint's config.json, with a checksum: an export carries the fields the model's config does
        not hold (architectures, auto_map, the user's own)."""
        _write_sealed(self.source_config, values)

    def read_source_config(self) -> dict[str, Any] | None:
        """The config.json `write_source_config` kept (None: the run started from no folder, or before it was
        kept), once its checksum says it is."""
        if not self.source_config.is_file():
            return None
        return _read_sealed(self.source_config, "the config.json of the checkpoint this run started from")

    def write_trace(self, trace: Trace, step: int) -> None:
        """trace.json, trace.chrome.json and memory.png (of `step`), each renamed into place, never through a link."""
        replace_file(self.trace_json, trace.to_json)
        replace_file(self.trace_chrome, trace.to_chrome)
        replace_file(self.plot, lambda tmp: trace.plot(tmp, step=step))

    def append_metrics(self, record: dict[str, Any]) -> None:
        _append_line(self.metrics, record)

    @property
    def reference_store(self) -> Path:
        """--method grpo with full fine-tuning and --beta: the initial weights, frozen (the KL's reference)."""
        return self.root / "reference-store"

    @property
    def completions(self) -> Path:
        """--method grpo: a sample of each step's completions (its first prompt's), one JSON line a step."""
        return self.root / "completions.jsonl"

    def append_completions(self, record: dict[str, Any]) -> None:
        _append_line(self.completions, record)

    def keep_completions_through(self, step: int) -> None:
        """completions.jsonl without the lines of steps after the committed `step` (a kill came before their
        commit) or one a kill cut short: the resumed run writes them again."""
        if not self.completions.is_file():
            return
        lines = self.completions.read_text(encoding="utf-8").splitlines(keepends=True)
        kept = [line for line in lines if line.endswith("\n") and _line_step(line) <= step]
        if kept != lines:
            write_json_atomic(self.completions, "".join(kept))

    def read_metrics(self) -> list[dict[str, Any]]:
        """The records; a last line that a kill cut short is left out."""
        if not self.metrics.is_file():
            return []
        lines = [line for line in self.metrics.read_text().splitlines() if line.strip()]
        records = []
        for i, line in enumerate(lines):
            try:
                records.append(json.loads(line))
            except ValueError:
                if i < len(lines) - 1:
                    raise RunError(f"{self.metrics} line {i + 1} is not JSON; fix or delete that line") from None
        return records

    def committed_step(self) -> int:
        """The step a run continues from: its store's last commit, or the step journaled after it (whose
        gradients are durable: opening the store rolls it forward). Under torchrun, the ranks' least, which is
        what they agree on. Reads only."""
        return min(journaled for _, journaled in self._steps())

    def committed_settings(self) -> TrainerConfig | None:
        """The trainer settings the store committed its last step with (None where it records none). Reads only."""
        saved = read_manifest(ranks.every_store(self.store)[0])["trainer"].get("config")
        return None if saved is None else TrainerConfig.from_dict(saved)

    def update_interrupted(self) -> bool:
        """Whether a store holds a journaled step whose update a kill interrupted: opening it for training rolls
        the step forward, and until then reading commands refuse the run. Reads only."""
        return any(manifest != journaled for manifest, journaled in self._steps())

    def kept(self) -> set[int]:
        """The steps every process's store keeps (`streamer train --keep-last`). Reads only."""
        return set.intersection(*(set(kept_steps(root)) for root in ranks.every_store(self.store)))

    def _steps(self) -> list[tuple[int, int]]:
        """(the manifest's step, the step journaled after it or else the manifest's) of every process's store."""
        steps = []
        for root in ranks.every_store(self.store):
            try:
                manifest = read_manifest(root)
            except StoreError:
                kept = kept_steps(root)
                if not kept:
                    raise
                steps.append((kept[-1], kept[-1]))  # opening it goes back to a kept step (HostStore.open)
                continue
            try:
                journal = read_journal(root, manifest, list(manifest["units"]))
            except StoreError:  # opening it resolves the step after the manifest's: as an interrupted one
                steps.append((manifest["step"], manifest["step"] + 1))
                continue
            steps.append((manifest["step"], manifest["step"] if journal is None else journal["step"]))
        return steps

    def keep_metrics_through(self, step: int, losses: list[float], tc: TrainerConfig) -> None:
        """metrics.jsonl holds each step up to the committed `step` exactly once: records of later steps (a kill
        came before they were committed, or a RAM-tier run's steps since its last save) go, and a step committed
        before a kill could log it gets its record back from the store's losses (without timings)."""
        records = self.read_metrics()
        kept = [r for r in records if r.get("step", 0) <= step]
        logged = {r["step"] for r in kept if "loss" in r}
        if len(losses) == step:
            kept += [{"step": n, "loss": losses[n - 1], "lr": tc.schedule.lr_at(n, tc.optimizer.lr)}
                     for n in range(1, step + 1) if n not in logged]
        kept.sort(key=lambda r: r.get("step", 0))  # stable: an evaluation stays after its step's record
        if kept != records or (self.metrics.is_file() and not self.metrics.read_text().endswith("\n")):
            write_json_atomic(self.metrics, "".join(json.dumps(r) + "\n" for r in kept))


def _append_line(path: Path, record: dict[str, Any]) -> None:
    with os.fdopen(open_for_writing(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT), "a", encoding="utf-8") as out:
        out.write(json.dumps(record) + "\n")


def _line_step(line: str) -> int:
    """A JSON line's step (a line that does not parse sorts after every step)."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return 2**62


def _hex(checksum: int) -> str:
    return f"{checksum:016x}"


def _write_sealed(path: Path, values: dict[str, Any]) -> None:
    """`values` as JSON with a checksum of their text, renamed into place."""
    write_json_atomic(path, json.dumps({"values": values, "checksum": checksum_of(json.dumps(values))}))


def _read_sealed(path: Path, what: str) -> dict[str, Any]:
    """The values `_write_sealed` kept in `path` (`what` they are), once their checksum says they are."""
    try:
        kept = json.loads(path.read_text())
        intact = checksum_of(json.dumps(kept["values"])) == kept["checksum"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise RunError(f"cannot read {path} ({exc}), {what}; restore it from a backup, or start a new run") from None
    if not intact:
        raise RunError(f"{path} is damaged (its checksum does not match its values), {what}; restore it from a "
                       "backup, or start a new run")
    return kept["values"]
