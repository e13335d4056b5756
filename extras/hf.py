"""Hugging Face directories in and out: Qwen2 and Llama checkpoints, the authors' MARS
releases among them, as checkpoints of this project, and ours as directories that
transformers (or any AR stack) loads as Qwen2ForCausalLM or LlamaForCausalLM.

    python hf.py export out/mars.pt hf_out      # then AutoModelForCausalLM.from_pretrained("hf_out")

In: config.json -> GPTConfig; *.safetensors (one file, or shards listed in
model.safetensors.index.json) -> our parameter names; tokenizer.json,
tokenizer_config.json (or chat_template.jinja) -> tokenizer.Tokenizer (tiktoken, the model's
own Jinja chat template). The result is a checkpoint dict like train.py's, so sampling,
evaluation and MARS fine-tuning read it unchanged. Supported: model_type qwen2, llama and
a2d-qwen2 (the authors' MARS release: Qwen2 weights, attention mask from the caller), with
plain rotary positions and full attention. Nothing here knows about MARS beyond its B.
"""
import json
import os
import re
from dataclasses import asdict

import torch
from safetensors import safe_open
from safetensors.torch import save_file

import tokenizer
from cli import Parser, run_cli
from model import GPTConfig

MODEL_TYPES = ("qwen2", "llama", "a2d-qwen2")

# Hugging Face parameter name -> ours; {} is the layer index
NAMES = {
    "model.embed_tokens.weight": "wte.weight",
    "model.norm.weight": "norm_f.weight",
    "lm_head.weight": "lm_head.weight",
    "model.layers.{}.input_layernorm.weight": "blocks.{}.norm1.weight",
    "model.layers.{}.post_attention_layernorm.weight": "blocks.{}.norm2.weight",
    **{f"model.layers.{{}}.self_attn.{x}_proj.{p}": f"blocks.{{}}.attn.{x}.{p}" for x in "qkv" for p in ("weight", "bias")},
    "model.layers.{}.self_attn.o_proj.weight": "blocks.{}.attn.o.weight",
    **{f"model.layers.{{}}.mlp.{x}_proj.weight": f"blocks.{{}}.mlp.{x}.weight" for x in ("gate", "up", "down")},
}
HF_NAMES = {ours: theirs for theirs, ours in NAMES.items()}


def rename(name, table):
    """A parameter's name in the other convention (ValueError for one that has no counterpart)."""
    layer = re.search(r"(?<=\.)\d+(?=\.)", name)
    generic = name[:layer.start()] + "{}" + name[layer.end():] if layer else name
    if generic not in table:
        raise ValueError(f"unexpected weight {name}")
    return table[generic].format(layer.group() if layer else "")


def config_from_hf(c):
    """GPTConfig of a Hugging Face config.json, or ValueError naming what is not supported."""
    kind = c.get("model_type")
    if kind not in MODEL_TYPES:
        raise ValueError(f"model_type {kind!r} is not supported (only {', '.join(MODEL_TYPES)})")
    rope = c.get("rope_scaling") or c.get("rope_parameters") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ValueError(f"rope_scaling {rope.get('rope_type', rope.get('type'))!r} is not supported "
                         "(plain rotary positions only)")
    if c.get("use_sliding_window") or any(t != "full_attention" for t in c.get("layer_types") or []):
        raise ValueError("sliding-window attention is not supported (full attention only)")
    extra = [k for k in ("attention_bias", "mlp_bias") if kind == "llama" and c.get(k)]
    if c.get("hidden_act", "silu") != "silu" or extra:
        raise ValueError(f"{extra or ['hidden_act ' + repr(c['hidden_act'])]} is not supported (Llama's SwiGLU block)")
    return GPTConfig(vocab_size=c["vocab_size"], max_seq_len=c["max_position_embeddings"],
                     n_layer=c["num_hidden_layers"], n_head=c["num_attention_heads"], n_embd=c["hidden_size"],
                     n_kv_head=c.get("num_key_value_heads") or 0, head_dim=c.get("head_dim") or 0,
                     intermediate_size=c["intermediate_size"],
                     rope_base=float(rope.get("rope_theta", c.get("rope_theta", 10000.0))),
                     norm_eps=c.get("rms_norm_eps", 1e-6), qkv_bias=kind != "llama",
                     tie_embeddings=bool(c.get("tie_word_embeddings", False)))


def read_json(path, name, default=None):
    file = os.path.join(path, name)
    if not os.path.isfile(file):
        if default is not None:
            return default
        raise OSError(f"{path}: no {name} (not a Hugging Face model directory?)")
    with open(file, encoding="utf-8") as f:
        return json.load(f)


def read_weights(path, device, dtype):
    """Our state dict from the directory's safetensors file or shards, on device, in dtype."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        files = sorted(set(read_json(path, "model.safetensors.index.json")["weight_map"].values()))
    else:
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise OSError(f"{path}: no *.safetensors weights")
    state = {}
    for file in files:
        with safe_open(os.path.join(path, file), framework="pt", device=str(device)) as f:
            for name in f.keys():
                if not name.endswith("rotary_emb.inv_freq"):  # a buffer some old checkpoints save
                    state[rename(name, NAMES)] = f.get_tensor(name).to(dtype)
    return state


def block_size(path, c):
    """MARS's B when the directory is a MARS model: our export records it; the authors' names say blk4, blk8,
    blk16 (read from the path, e.g. a hub cache's models--Xalphinions--MARS-Qwen2.5-0.5B-blk8/...), else 4."""
    if "mars_block_size" in c:
        return int(c["mars_block_size"])
    if c.get("model_type") == "a2d-qwen2":
        found = re.findall(r"blk(\d+)", os.path.abspath(path))
        return int(found[-1]) if found else 4
    return None


def read_checkpoint(path, device="cpu", dtype=None):
    """A Hugging Face model directory as a checkpoint dict of this project:
    {"model", "model_config", "tokenizer", "stage": "hf", "hf": {"path", "model_type"}}, plus
    "mars": {"B"} for a MARS model. Weights in dtype (default float32), on device."""
    c = read_json(path, "config.json")
    config = config_from_hf(c)
    state = read_weights(path, device, dtype or torch.float32)
    if config.tie_embeddings:
        state["lm_head.weight"] = state["wte.weight"]
    elif "lm_head.weight" not in state:
        raise ValueError(f"{path}: untied output head (tie_word_embeddings false) but no lm_head.weight")
    template = os.path.join(path, "chat_template.jinja")
    template = open(template, encoding="utf-8").read() if os.path.isfile(template) else None
    tok = tokenizer.Tokenizer.from_hf(read_json(path, "tokenizer.json"), read_json(path, "tokenizer_config.json", {}),
                                 template, n_rows=config.vocab_size)
    ckpt = {"model": state, "model_config": asdict(config), "tokenizer": tok.state(), "stage": "hf",
            "hf": {"path": os.path.abspath(path), "model_type": c["model_type"]}}
    B = block_size(path, c)
    if B:
        ckpt["mars"] = {"B": B}
    return ckpt


def export(ckpt, out_dir):
    """Write a checkpoint dict (ours or read_checkpoint's) as a Hugging Face directory: config.json
    (model_type qwen2 with q/k/v biases, else llama; MARS's B as mars_block_size), model.safetensors,
    tokenizer.json and tokenizer_config.json (chat template, <|mask|> an added special token)."""
    config, tok = GPTConfig(**ckpt["model_config"]), tokenizer.Tokenizer.from_state(ckpt["tokenizer"])
    kind = "qwen2" if config.qkv_bias else "llama"
    dtype = ckpt["model"]["wte.weight"].dtype
    rope = {"rope_type": "default", "rope_theta": config.rope_base}
    hf_config = {
        "architectures": ["Qwen2ForCausalLM" if config.qkv_bias else "LlamaForCausalLM"], "model_type": kind,
        "vocab_size": config.vocab_size, "max_position_embeddings": config.max_seq_len,
        "num_hidden_layers": config.n_layer, "num_attention_heads": config.n_head, "hidden_size": config.n_embd,
        "num_key_value_heads": config.n_kv_head, "head_dim": config.head_dim,
        "intermediate_size": config.intermediate_size, "hidden_act": "silu", "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_base, "rope_parameters": rope, "rope_scaling": None,
        "tie_word_embeddings": config.tie_embeddings, "eos_token_id": tok.eot, "pad_token_id": tok.eot,
        "torch_dtype": str(dtype).removeprefix("torch."), "use_cache": True,
        **({"use_sliding_window": False, "sliding_window": None} if config.qkv_bias else
           {"attention_bias": False, "mlp_bias": False}),
    }
    if "mars" in ckpt:
        hf_config["mars_block_size"] = ckpt["mars"]["B"]
    skip = {"lm_head.weight"} if config.tie_embeddings else set()
    weights = {rename(k, HF_NAMES): v.detach().to("cpu").contiguous() for k, v in ckpt["model"].items() if k not in skip}
    tokenizer_json, tokenizer_config = tok.to_hf()
    tokenizer_config["model_max_length"] = config.max_seq_len
    os.makedirs(out_dir, exist_ok=True)
    save_file(weights, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    files = {"config.json": hf_config, "tokenizer.json": tokenizer_json, "tokenizer_config.json": tokenizer_config,
             "generation_config.json": {"eos_token_id": tok.eot, "pad_token_id": tok.eot, "do_sample": False}}
    for name, obj in files.items():
        with open(os.path.join(out_dir, name), "w", encoding="utf-8") as f:
            json.dump(obj, f, ensure_ascii=False, indent=1)


def load_any(path):
    """A checkpoint dict from one of our .pt files or a Hugging Face directory."""
    if os.path.isdir(path):
        return read_checkpoint(path)
    if not os.path.isfile(path):
        raise OSError(f"checkpoint not found: {path}")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
        assert isinstance(ckpt, dict) and {"model", "model_config", "tokenizer"} <= ckpt.keys()
    except Exception:
        raise ValueError(f"not a readable checkpoint of this project: {path}") from None
    return ckpt


def main(argv=None):
    p = Parser(__doc__)
    p.add_argument("command", choices=["export"])
    p.add_argument("ckpt", help="our checkpoint (.pt) or a Hugging Face directory")
    p.add_argument("out_dir", help="the Hugging Face directory to write")
    args = p.parse_args(argv)
    export(load_any(args.ckpt), args.out_dir)
    print(f"wrote {args.out_dir}")


if __name__ == "__main__":
    run_cli(main)
