"""Build a tiny random-weight Llama (and its own tokenizer) that real vLLM can serve on a CPU.

Why: end-to-end tests need a real engine — real scheduler, real prefix cache, real
metrics — but no model download (nothing leaves the machine) and no real weights.
Everything is seeded, so two builds give the same files. Run with .venv-vllm's python:

    .venv-vllm/bin/python loadtest/realvllm/model.py OUT_DIR
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
import time
from pathlib import Path

__all__ = ["build", "build_tokenizer", "corpus"]

VOCAB_SIZE = 4096
SPECIAL_TOKENS = ["<s>", "</s>", "<unk>", "<pad>"]
# `<|role|>content` per message, then the assistant's turn marker when asked for it.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
_WORDS = (
    "the a an of to in on for with by from at as is are was were be been this that these those it its "
    "system user assistant request reply cache prefix block token model server gateway replica route "
    "policy queue load memory engine batch stream chunk prompt answer question context document "
    "section table figure value number time data page line word text code test error result report "
    "alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega red green blue yellow black "
    "white one two three four five six seven eight nine ten hundred thousand first second last next "
    "please explain summarise describe list compare write read find check keep move send stop start"
).split()
_MARKS = ("<|system|>", "<|user|>", "<|assistant|>")


def corpus(lines: int = 4000, seed: int = 0) -> list[str]:
    """Generated text covering words, digits, punctuation and the chat markers."""
    rng = random.Random(seed)
    out = []
    for i in range(lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(6, 24))]
        mark = _MARKS[i % len(_MARKS)]
        out.append(f"{mark}{' '.join(words)} {rng.randint(0, 99999)}, {rng.choice('.,;:!?')}")
    return out


def _train_tokenizer(out_dir: Path, specials: list[str] = SPECIAL_TOKENS) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    tok.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": "<pad>",
        "add_bos_token": False,
        "model_max_length": 2048,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (out_dir / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"})
    )


def build_tokenizer(out_dir: Path, chat_markers: bool = False) -> Path:
    """The tiny model's tokenizer files alone (tokenizer.json + config with its chat template):
    needs only ``tokenizers``, for the gateway's local tokenizer and the simulator. With
    ``chat_markers`` the template's ``<|role|>`` markers are special tokens, as real models'
    turn delimiters are (a variant: the served tiny model keeps them as text)."""
    if not (out_dir / "tokenizer_config.json").is_file():
        out_dir.mkdir(parents=True, exist_ok=True)
        _train_tokenizer(out_dir, SPECIAL_TOKENS + list(_MARKS) if chat_markers else SPECIAL_TOKENS)
    return out_dir


def _write_model(out_dir: Path, seed: int) -> None:
    import torch
    from safetensors.torch import save_file

    tok = json.loads((out_dir / "tokenizer.json").read_text())["model"]["vocab"]
    bos, eos, pad = tok["<s>"], tok["</s>"], tok["<pad>"]
    hidden, inter, layers, heads, kv_heads = 128, 256, 2, 4, 2
    head_dim = hidden // heads
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": pad,
        "torch_dtype": "bfloat16",
        "initializer_range": 0.02,
    }
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)

    tensors = {"model.embed_tokens.weight": rand(VOCAB_SIZE, hidden)}
    tensors["lm_head.weight"] = rand(VOCAB_SIZE, hidden)
    tensors["model.norm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors[p + "self_attn.q_proj.weight"] = rand(heads * head_dim, hidden)
        tensors[p + "self_attn.k_proj.weight"] = rand(kv_heads * head_dim, hidden)
        tensors[p + "self_attn.v_proj.weight"] = rand(kv_heads * head_dim, hidden)
        tensors[p + "self_attn.o_proj.weight"] = rand(hidden, heads * head_dim)
        tensors[p + "mlp.gate_proj.weight"] = rand(inter, hidden)
        tensors[p + "mlp.up_proj.weight"] = rand(inter, hidden)
        tensors[p + "mlp.down_proj.weight"] = rand(hidden, inter)
        tensors[p + "input_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        tensors[p + "post_attention_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    generation = {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad, "do_sample": False}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2))


def digest(out_dir: Path) -> str:
    """One hash over every file, to check that builds are reproducible."""
    h = hashlib.sha256()
    for path in sorted(out_dir.iterdir()):
        if path.is_file() and path.name != "BUILD_INFO":
            h.update(path.name.encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def build(out_dir: Path, seed: int = 0) -> Path:
    """Write the model into ``out_dir`` (no-op when a complete build is already there)."""
    marker = out_dir / "BUILD_INFO"
    if marker.exists():
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    _train_tokenizer(out_dir)
    _write_model(out_dir, seed)
    info = {"seed": seed, "build_s": round(time.perf_counter() - started, 2), "sha256": digest(out_dir)}
    marker.write_text(json.dumps(info))
    return out_dir


if __name__ == "__main__":
    target = Path(sys.argv[1] if len(sys.argv) > 1 else ".venv-vllm/models/tiny-llama")
    build(target)
    print((target / "BUILD_INFO").read_text())
