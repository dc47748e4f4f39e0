"""Smoke test of the installed tools: `kvzap train` and `kvzap evaluate` on a tiny model, from any directory.

Run it with the Python of an environment where kvzap is installed (a wheel, or ``pip install -e``), from a
directory outside the checkout::

    cd "$(mktemp -d)" && /path/to/venv/bin/python /path/to/kvzap/.ci/smoke_tools.py

It checks that no generic top-level module (``train``, ``evaluation``) is importable, writes a tiny random Llama
(built from a config) with a character-level tokenizer and a few tiny texts to a temporary directory, then runs
the ``kvzap`` console script next to this Python: ``train --help``, ``evaluate --help``, ``train all`` (collect +
fit, both surrogate types) and ``evaluate`` sweeping ``kvzap_mlp`` and ``kvzap_linear`` from that one training
run. Everything is offline and takes well under a minute on two CPU cores. Exits non-zero on the first failure.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
WORDS = "the cache keeps every key and value of the context while the model answers a question about it".split()


def tiny_model(directory: Path) -> None:
    """A seeded 2-layer Llama (hidden 64) and a character-level tokenizer with a chat template, saved together."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>", "<|end|>"]
    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    backend = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(specials + chars)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )
    tokenizer.add_special_tokens({"additional_special_tokens": specials[4:]})
    tokenizer.chat_template = CHAT_TEMPLATE
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def tiny_texts(path: Path) -> None:
    """Eight texts of ~300 characters in two subsets (the prompt quotas are per subset)."""
    rng = random.Random(0)
    with path.open("w", encoding="utf-8") as handle:
        for i in range(8):
            text = " ".join(rng.choice(WORDS) for _ in range(60))
            handle.write(json.dumps({"text": text, "subset": f"kind{i % 2}"}) + "\n")


def run_kvzap(*args: str) -> str:
    """Run the installed ``kvzap`` command (next to this Python) and return its output; fail loudly."""
    command = [str(Path(sys.executable).with_name("kvzap")), *args]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    print(f"$ kvzap {' '.join(args[:2])} ... -> exit {done.returncode} in {time.perf_counter() - start:.1f} s")
    if done.returncode != 0:
        sys.exit(f"`kvzap {' '.join(args)}` failed:\n{done.stdout}\n{done.stderr}")
    return done.stdout


def check(condition: bool, message: str) -> None:
    if not condition:
        sys.exit(message)


def main() -> int:
    os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    for generic in ("train", "evaluation"):
        if importlib.util.find_spec(generic) is not None:
            sys.exit(f"A top-level module {generic!r} is importable from {os.getcwd()}: it must not be installed.")
    import kvzap

    print(f"kvzap from {Path(kvzap.__file__).parent}, working directory {os.getcwd()}")
    # The wheel carries the kernel's C++ source, and it builds (or loads from torch's extension cache).
    from kvzap.paged import kernels

    kernels.build()
    check(kernels.kernel_status() == "loaded", f"The CPU decode kernel did not load: {kernels.kernel_status()}")
    for command in ("train", "evaluate"):
        check(f"usage: kvzap {command}" in run_kvzap(command, "--help"), f"`kvzap {command} --help` shows no usage.")
    # The bundled surrogates are package data: every one of them must be in the wheel, loadable.
    from kvzap import KVzapScorer, KVzapSurrogate
    from kvzap.surrogates import bundled_surrogate_dir, list_bundled

    expected = {
        "SmolLM2-135M-Instruct": ["fastkvzip", "linear", "mlp", "mlp-average"],
        "gemma-3-270m": ["linear", "mlp"],
    }
    check(list_bundled() == expected, f"The wheel's bundled surrogates are {list_bundled()}, expected {expected}.")
    KVzapScorer("mlp", variant="average")
    for model_type in ("linear", "mlp", "mlp-average"):
        KVzapSurrogate.from_pretrained(bundled_surrogate_dir("SmolLM2-135M-Instruct", model_type))

    with tempfile.TemporaryDirectory(prefix="kvzap-smoke-") as tmp:
        root = Path(tmp)
        tiny_model(root / "model")
        tiny_texts(root / "texts.jsonl")
        out = run_kvzap(
            "train", "--threads", "1", "all", "--model", str(root / "model"), "--data", str(root / "texts.jsonl"),
            "--out", str(root / "train"), "--train-per-subset", "2", "--test-per-subset", "1", "--min-tokens", "60",
            "--max-tokens", "120", "--n-tokens", "16", "--epochs", "2", "--batch-size", "16", "--hidden-dim", "8",
        )  # fmt: skip
        check("train: 4 prompts" in out and "held-out mean R^2" in out, f"Unexpected `kvzap train all` output:\n{out}")
        surrogates = root / "train" / "surrogates"
        for kind in ("mlp", "linear"):
            if not (surrogates / kind / "config.json").is_file():
                sys.exit(f"`kvzap train all` wrote no {kind} surrogate in {surrogates}.")
        out = run_kvzap(
            "evaluate", "--model", str(root / "model"), "--press", "no_press", "kvzap_mlp", "kvzap_linear",
            "--surrogate", str(surrogates), "--threshold", "0", "--tasks", "niah_single", "--lengths", "400",
            "--n-samples", "1", "--max-new-tokens", "2", "--output-dir", str(root / "eval"),
        )  # fmt: skip
        records = [json.loads(p.read_text()) for p in (root / "eval").rglob("config.json")]
        used = {r["press"]: r["surrogate"] for r in records}
        expected = {"no_press": None, "kvzap_mlp": str(surrogates / "mlp"), "kvzap_linear": str(surrogates / "linear")}
        if used != expected:
            sys.exit(f"The sweep's runs read {used}, expected {expected}:\n{out}")
        print(out)
    print("smoke test of the installed tools: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
