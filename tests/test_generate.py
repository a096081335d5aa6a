"""Generation with streamed layers: the KV cache changes nothing but speed, sampling does what it says, and a chat
is prompted as transformers' apply_chat_template prompts it."""
from __future__ import annotations

import json

import pytest
import torch

from layers import GPTJ, GPTJConfig
from streamer import StreamerError, StreamingTrainer, TrainerConfig
from streamer.generate import Sampling, complete, generate, sample_next
from streamer.io.tokenizer import train_bpe

DEBUG = GPTJConfig.preset("gptj-debug")
TINY = GPTJConfig(vocab_size=512, n_positions=64, n_embd=64, n_layer=2, n_head=4, rotary_dim=8)


@pytest.fixture(scope="module")
def trainer():
    """A debug model under a budget far below its 16 B/param training state: generation must stream."""
    budget = DEBUG.num_params() * 16 // 3
    with StreamingTrainer(DEBUG, TrainerConfig.of(dtype="fp32", budget=budget, seed=3)) as t:
        yield t


def prompts(batch: int = 2, length: int = 6, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, DEBUG.vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))


def resident_greedy(trainer: StreamingTrainer, ids: torch.Tensor, new: int) -> torch.Tensor:
    model = GPTJ(trainer.cfg, init=False)
    model.load_hf_state_dict(trainer.state_dict())
    with torch.no_grad():
        for _ in range(new):
            ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids


def test_greedy_with_cache_equals_without_and_the_resident_model(trainer):
    ids = prompts()
    cached = generate(trainer, ids, Sampling(max_new_tokens=12))
    recomputed = generate(trainer, ids, Sampling(max_new_tokens=12, use_cache=False))
    assert cached.shape == (2, 18)
    assert torch.equal(cached[:, :6], ids)
    assert torch.equal(cached, recomputed)
    assert torch.equal(cached, resident_greedy(trainer, ids, 12))


def test_generation_streams_within_the_budget_and_frees_its_cache(trainer):
    trainer.ledger.reset_peak()
    generate(trainer, prompts(), Sampling(max_new_tokens=5))
    assert trainer.ledger.in_use == 0
    assert 0 < trainer.ledger.peak <= trainer.tc.device.budget_bytes() < 16 * DEBUG.num_params()
    spans = [e for e in trainer.trace.spans() if e.phase == "generate"]
    assert {e.layer for e in spans} == set(trainer.units)


def test_sampling_is_seeded_and_stays_in_the_top_k(trainer):
    ids = prompts(batch=1)
    settings = Sampling(max_new_tokens=12, temperature=1.5, top_k=3, seed=7)
    first, again = generate(trainer, ids, settings), generate(trainer, ids, settings)
    assert torch.equal(first, again)
    assert not torch.equal(first, generate(trainer, ids, Sampling(max_new_tokens=12, temperature=1.5, seed=8)))
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    allowed = logits.topk(3).indices
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        picked = sample_next(logits, Sampling(temperature=2.0, top_k=3), gen)
        assert (allowed == picked[:, None]).any(dim=1).all()


def test_narrow_sampling_reduces_to_greedy():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(2))
    gen = torch.Generator().manual_seed(0)
    greedy = logits.argmax(-1)
    assert torch.equal(sample_next(logits, Sampling(temperature=1.0, top_k=1), gen), greedy)
    assert torch.equal(sample_next(logits, Sampling(temperature=1.0, top_p=1e-6), gen), greedy)
    # top-p keeps the smallest set reaching p: with one token at 0.9 probability and p=0.5, only that one.
    peaked = torch.tensor([[10.0, 7.8, 0.0, 0.0]])
    assert all(sample_next(peaked, Sampling(temperature=1.0, top_p=0.5), gen).item() == 0 for _ in range(20))


def test_stop_token_ends_generation_and_pads_finished_rows(trainer):
    ids = prompts(batch=2)
    free_run = generate(trainer, ids, Sampling(max_new_tokens=10))
    stop = int(free_run[0, 8])  # row 0 reaches this token after 3 new tokens
    stopped = generate(trainer, ids, Sampling(max_new_tokens=10), stop_id=stop)
    first_stop = [int((row[6:] == stop).nonzero()[0]) if (row[6:] == stop).any() else None for row in stopped]
    assert first_stop[0] is not None and first_stop[0] <= 2
    for row, at in zip(stopped, first_stop, strict=True):
        if at is not None:
            assert (row[6 + at:] == stop).all()


def test_bad_requests_are_one_line_errors(trainer):
    with pytest.raises(StreamerError, match="context of 64"):
        generate(trainer, prompts(length=60), Sampling(max_new_tokens=10))
    with pytest.raises(StreamerError, match="at least one token"):
        generate(trainer, torch.zeros(1, 0, dtype=torch.long))
    for bad in ({"temperature": -1.0}, {"top_k": -2}, {"top_p": 0.0}, {"max_new_tokens": 0}):
        with pytest.raises(StreamerError):
            Sampling(**bad)


def test_complete_decodes_text_and_stops_at_end_of_text():
    from pydoc_data.topics import topics
    tokenizer = train_bpe(list(topics.values())[:40], vocab_size=TINY.vocab_size)
    with StreamingTrainer(TINY, TrainerConfig.of(dtype="fp32", seed=1)) as t:
        text = complete(t, tokenizer, "The for statement", Sampling(max_new_tokens=8, temperature=0.7, seed=1))
        assert isinstance(text, str) and "<|endoftext|>" not in text
        ids = tokenizer.encode("The for statement")
        greedy = generate(t, torch.tensor([ids]), Sampling(max_new_tokens=8))[0, len(ids):].tolist()
        if tokenizer.eos_id in greedy:
            greedy = greedy[:greedy.index(tokenizer.eos_id)]
        assert complete(t, tokenizer, "The for statement", Sampling(max_new_tokens=8)) == tokenizer.decode(greedy)
        assert isinstance(complete(t, tokenizer, "", Sampling(max_new_tokens=3)), str)  # starts from end-of-text


# --- chat: --chat, --messages, --system ----------------------------------------------------------------------------
# Llama 3.1's template, shortened: it writes the BOS itself, reads `tools`, calls strftime_now, as the real one does.
LLAMA3_TEMPLATE = """{{- bos_token }}
{%- if not date_string is defined %}{%- set date_string = strftime_now("%d %b %Y") %}{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}{{- "Environment: ipython\\n" }}{%- endif %}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""  # noqa: E501 (Llama 3's template, verbatim)
HISTORY = [{"role": "user", "content": "What is a loop?"}, {"role": "assistant", "content": "A for statement."}]
SYSTEM, QUESTION = "Answer briefly.", "What does the while statement do?"


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory, tiny_setup):
    """A Llama run from a transformers folder whose tokenizer, as Llama 3's does, adds a BOS by its post-processor
    and names a chat template that writes the BOS itself: that folder, the run, its model and a messages file."""
    import tokenizers
    from pydoc_data.topics import topics
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    from layers import LlamaConfig
    from streamer.cli.main import main
    from tests.test_llama import _TINY, hf_model
    root = tmp_path_factory.mktemp("chat")
    specials = ["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"]
    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(list(topics.values())[:40], trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    backend.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                           special_tokens=[("<|begin_of_text|>", 0)])
    hf = root / "hf"
    cfg = LlamaConfig(**{**_TINY, "vocab_size": 512, "max_position_embeddings": 256})
    hf_model(cfg).save_pretrained(hf)
    backend.save(str(hf / "tokenizer.json"))
    (hf / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
        "chat_template": LLAMA3_TEMPLATE}))
    run = root / "run"
    assert main([str(a) for a in ("train", "--from-pretrained", hf, "--data", tiny_setup / "train.txt", "--run-dir",
                                  run, "--steps", 1, "--batch", 2, "--seq", 32, "--dtype", "fp32",
                                  "--sample-tokens", 0, "--eval-fraction", 0)]) == 0
    (root / "history.json").write_text(json.dumps(HISTORY))
    return {"hf": hf, "run": run, "cfg": cfg, "history": root / "history.json", "data": tiny_setup / "train.txt"}


def test_a_chat_renders_as_transformers_and_generates_its_greedy_tokens(chat_run):
    """The run's template renders --system, --messages and --chat into the ids transformers' apply_chat_template
    gives (one BOS: the template's); greedy generation on them is transformers' generate on the run's weights,
    and `streamer generate`, typed as a user types it, prints that prompt and those tokens."""
    import subprocess
    import sys

    import transformers

    from streamer.cli.generate import open_trainer
    from streamer.io.data import chat_prompt
    from streamer.io.tokenizer import load_tokenizer
    from streamer.run_dir import RunDir
    messages = [{"role": "system", "content": SYSTEM}, *HISTORY, {"role": "user", "content": QUESTION}]
    theirs = transformers.AutoTokenizer.from_pretrained(chat_run["hf"])
    expected = theirs.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    tokenizer = load_tokenizer(RunDir(chat_run["run"]).tokenizer)
    rendered = chat_prompt(messages, tokenizer, "the conversation")
    ids = tokenizer.encode(rendered)
    assert ids == expected and ids.count(tokenizer.bos_id) == 1 and ids[0] == tokenizer.bos_id
    assert theirs("Hi")["input_ids"][0] == tokenizer.bos_id  # the tokenizer adds a BOS to plain text

    with open_trainer(RunDir(chat_run["run"])) as trainer:
        state = trainer.state_dict()
        ours = generate(trainer, torch.tensor([ids]), Sampling(max_new_tokens=8), stop_id=tokenizer.eos_id)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**chat_run["cfg"].adapter().to_hf()), attn_implementation="eager").eval()
    model.load_state_dict(state)
    with torch.no_grad():
        greedy = model.generate(torch.tensor([expected]), max_new_tokens=8, do_sample=False,
                                eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.eos_id)
    assert ours.tolist() == greedy.tolist()

    done = subprocess.run([sys.executable, "-m", "streamer", "generate", str(chat_run["run"]), "--messages",
                           str(chat_run["history"]), "--system", SYSTEM, "--chat", QUESTION, "--temperature", "0",
                           "--max-new-tokens", "8"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    new = greedy[0, len(expected):].tolist()
    reply = tokenizer.decode(new[:-1] if new[-1] == tokenizer.eos_id else new)
    assert done.stdout.startswith(rendered + reply + "\n"), (done.stdout, json.dumps(rendered + reply))


def test_chat_inputs_are_one_conversation_however_given(chat_run, capsys, tmp_path):
    """--messages as a JSON list or JSON Lines, and --system + --chat, are the same conversation; a run without a
    chat template takes --chat-template FILE; wrong input is one line naming its flag."""
    import shutil

    from tests.test_cli import fails, run_cli
    run = chat_run["run"]
    pair = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    (tmp_path / "pair.json").write_text(json.dumps(pair))
    (tmp_path / "pair.jsonl").write_text("".join(json.dumps(m) + "\n" for m in pair))
    greedy = ("--temperature", 0, "--max-new-tokens", 4)
    outputs = [run_cli(capsys, "generate", run, *argv, *greedy) for argv in (
        ("--messages", tmp_path / "pair.json"), ("--messages", tmp_path / "pair.jsonl"),
        ("--system", SYSTEM, "--chat", QUESTION))]
    assert all(rc == 0 for rc, _, _ in outputs), outputs
    assert len({out.splitlines()[0] for _, out, _ in outputs}) == 1  # the prompt and the reply
    assert "<|start_header_id|>assistant<|end_header_id|>" in outputs[0][1]

    # A run of the same model whose tokenizer names no chat template (a run's own tokenizer files are checked,
    # so it is trained from such a folder, not edited afterwards).
    hf, bare = tmp_path / "hf-bare", tmp_path / "bare"
    shutil.copytree(chat_run["hf"], hf)
    config = json.loads((hf / "tokenizer_config.json").read_text())
    (hf / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": None}))
    rc, _, err = run_cli(capsys, "train", "--from-pretrained", hf, "--data", chat_run["data"], "--run-dir", bare,
                         "--steps", 1, "--batch", 2, "--seq", 32, "--dtype", "fp32", "--sample-tokens", 0,
                         "--eval-fraction", 0)
    assert rc == 0, err
    assert "pass --chat-template FILE" in fails(capsys, "generate", bare, "--chat", QUESTION)
    (tmp_path / "llama3.jinja").write_text(LLAMA3_TEMPLATE)
    rc, out, err = run_cli(capsys, "generate", bare, "--system", SYSTEM, "--chat", QUESTION,
                           "--chat-template", tmp_path / "llama3.jinja", *greedy)
    assert rc == 0 and out.splitlines()[0] == outputs[0][1].splitlines()[0], err

    assert "pass one or the other" in fails(capsys, "generate", run, "--prompt", "Hi", "--chat", QUESTION)
    assert "pass --prompt TEXT, or --chat TEXT" in fails(capsys, "generate", run, "--system", SYSTEM)
    assert "drop --system or that message" in fails(capsys, "generate", run, "--messages", tmp_path / "pair.json",
                                                    "--system", SYSTEM)
    (tmp_path / "bad.jsonl").write_text('{"role": "user", "content": "Hi"}\n{"role": "user",\n')
    assert "is neither JSON nor JSON Lines (line 2" in fails(capsys, "generate", run, "--messages",
                                                              tmp_path / "bad.jsonl")
    (tmp_path / "bad.json").write_text(json.dumps([{"role": "robot", "content": "Hi"}]))
    assert "'role' must be one of" in fails(capsys, "generate", run, "--messages", tmp_path / "bad.json")
    assert "cannot read --messages" in fails(capsys, "generate", run, "--messages", tmp_path / "missing.json")
