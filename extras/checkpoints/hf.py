"""Hugging Face directories in and out: Qwen2 and Llama checkpoints, the authors' MARS
releases among them, as checkpoints of this project, and ours as directories that
transformers (or any AR stack) loads as Qwen2ForCausalLM or LlamaForCausalLM.

    python -m extras.checkpoints.export out/mars.pt hf_out      # export(): then AutoModelForCausalLM.from_pretrained("hf_out")

In: config.json -> GPTConfig; *.safetensors (one file, or shards listed in
model.safetensors.index.json) -> our parameter names; tokenizer.json,
tokenizer_config.json (or chat_template.jinja) -> HFTokenizer (extras/checkpoints/hf_tokenizer.py:
tiktoken, and the model's own Jinja chat template). The result is a checkpoint dict like
train.py's, so sampling, evaluation and MARS fine-tuning read it unchanged. Supported:
model_type qwen2, llama and a2d-qwen2 (the authors' MARS release: Qwen2 weights, attention mask
from the caller), with plain rotary positions and full attention. A damaged directory is one
ValueError or OSError naming the file and what is wrong. Nothing here knows about MARS beyond its B.
"""
import json
import os
import re
from dataclasses import asdict

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from extras.checkpoints.hf_tokenizer import PAD, ChatTemplateError, HFTokenizer, from_hf, to_hf
from model import GPT, GPTConfig

MODEL_TYPES = ("qwen2", "llama", "a2d-qwen2")
INDEX = "model.safetensors.index.json"

# Hugging Face parameter name -> ours; {} is the layer index
NAMES = {
    "model.embed_tokens.weight": "wte.weight",
    "model.norm.weight": "norm_f.weight",
    "lm_head.weight": "lm_head.weight",
    "model.layers.{}.input_layernorm.weight": "layers.{}.norm1.weight",
    "model.layers.{}.post_attention_layernorm.weight": "layers.{}.norm2.weight",
    **{f"model.layers.{{}}.self_attn.{x}_proj.{p}": f"layers.{{}}.attn.{x}.{p}" for x in "qkv" for p in ("weight", "bias")},
    "model.layers.{}.self_attn.o_proj.weight": "layers.{}.attn.o.weight",
    **{f"model.layers.{{}}.mlp.{x}_proj.weight": f"layers.{{}}.mlp.{x}.weight" for x in ("gate", "up", "down")},
}
HF_NAMES = {ours: theirs for theirs, ours in NAMES.items()}


def rename(name, table):
    """A parameter's name in the other convention (ValueError for one that has no counterpart)."""
    layer = re.search(r"(?<=\.)\d+(?=\.)", name)
    generic = name[:layer.start()] + "{}" + name[layer.end():] if layer else name
    if generic not in table:
        raise ValueError(f"unexpected weight {name}")
    return table[generic].format(layer.group() if layer else "")


def number(c, key, kind=int, default=None):
    """c[key] as a positive int (or a number), else ValueError naming config.json and the key."""
    v = c.get(key, default)
    if v is None:
        raise ValueError(f"config.json: no {key}")
    if isinstance(v, bool) or not isinstance(v, (int, float) if kind is float else int) or v <= 0:
        raise ValueError(f"config.json: {key} must be a positive {'number' if kind is float else 'integer'}, "
                         f"got {json.dumps(v)[:60]}")
    return kind(v)


def config_from_hf(c):
    """GPTConfig of a Hugging Face config.json, or ValueError naming what is not supported."""
    if not isinstance(c, dict):
        raise ValueError(f"config.json: not a JSON object (a {type(c).__name__})")
    kind = c.get("model_type")
    if kind not in MODEL_TYPES:
        raise ValueError(f"config.json: model_type {kind!r} is not supported (only {', '.join(MODEL_TYPES)})")
    rope = c.get("rope_scaling") or c.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise ValueError(f"config.json: rope_scaling must be an object or null, got {json.dumps(rope)[:60]}")
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ValueError(f"config.json: rope_scaling {rope.get('rope_type', rope.get('type'))!r} is not supported "
                         "(plain rotary positions only)")
    if c.get("use_sliding_window") or any(t != "full_attention" for t in c.get("layer_types") or []):
        raise ValueError("config.json: sliding-window attention is not supported (full attention only)")
    extra = [k for k in ("attention_bias", "mlp_bias") if kind == "llama" and c.get(k)]
    if c.get("hidden_act", "silu") != "silu" or extra:
        raise ValueError(f"config.json: {extra or ['hidden_act ' + repr(c['hidden_act'])]} is not supported "
                         "(Llama's SwiGLU MLP)")
    optional = {k: number(c, k) if c.get(k) is not None else 0 for k in ("num_key_value_heads", "head_dim")}
    try:
        return GPTConfig(vocab_size=number(c, "vocab_size"), max_seq_len=number(c, "max_position_embeddings"),
                         n_layer=number(c, "num_hidden_layers"), n_head=number(c, "num_attention_heads"),
                         n_embd=number(c, "hidden_size"), n_kv_head=optional["num_key_value_heads"],
                         head_dim=optional["head_dim"], intermediate_size=number(c, "intermediate_size"),
                         rope_base=number(rope, "rope_theta", float, c.get("rope_theta", 10000.0)),
                         norm_eps=number(c, "rms_norm_eps", float, 1e-6), qkv_bias=kind != "llama",
                         tie_embeddings=bool(c.get("tie_word_embeddings", False)))
    except ValueError as e:
        raise ValueError(str(e) if str(e).startswith("config.json") else f"config.json: {e}") from None


def read_json(path, name, default=None):
    """The JSON object in path/name (default when the file is absent and a default is given)."""
    file = os.path.join(path, name)
    if not os.path.isfile(file):
        if default is not None:
            return default
        raise OSError(f"no {name} (not a Hugging Face model directory?)")
    try:
        with open(file, encoding="utf-8") as f:
            obj = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{name}: not valid JSON ({e})") from None
    if name != "config.json" and not isinstance(obj, dict):  # config_from_hf says what config.json lacks
        raise ValueError(f"{name}: not a JSON object (a {type(obj).__name__})")
    return obj


def weight_files(path):
    """The safetensors files of the directory: the shards its index names, else every *.safetensors."""
    if not os.path.isfile(os.path.join(path, INDEX)):
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        if not files:
            raise OSError("no *.safetensors weights")
        return files
    weight_map = read_json(path, INDEX).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise ValueError(f"{INDEX}: no weight_map of weight names to file names")
    for f in set(weight_map.values()):
        # names, not resolved paths: a hub cache's files are links into ../../blobs, and that is fine
        if os.path.isabs(f) or os.path.normpath(f).split(os.sep)[0] in ("..", ""):
            raise ValueError(f"{INDEX}: shard {f!r} is outside the model directory")
        if not os.path.isfile(os.path.join(path, f)):
            raise OSError(f"{INDEX}: shard {f} is missing")
    return sorted(set(weight_map.values()))


def read_weights(path, device, dtype):
    """Our state dict from the directory's safetensors file or shards, on device, in dtype, and the file
    of each weight."""
    state, where = {}, {}
    for file in weight_files(path):
        try:
            with safe_open(os.path.join(path, file), framework="pt", device=str(device)) as f:
                for name in f.keys():
                    if not name.endswith("rotary_emb.inv_freq"):  # a buffer some old checkpoints save
                        ours = rename(name, NAMES)
                        state[ours], where[ours] = f.get_tensor(name).to(dtype), file
        except ValueError as e:
            raise ValueError(f"{file}: {e}") from None
        except SafetensorError as e:  # empty, truncated, or not safetensors at all
            raise ValueError(f"{file}: not a readable safetensors file ({' '.join(str(e).split())[:120]})") from None
    return state, where


def check_weights(state, where, config):
    """ValueError naming the file and the weight, for a weight that is missing, extra or of the wrong shape."""
    with torch.device("meta"):
        want = {k: tuple(v.shape) for k, v in GPT(config).state_dict().items()}
    missing, extra = sorted(want.keys() - state.keys()), sorted(state.keys() - want.keys())
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        files = ", ".join(sorted(set(where.values()))) or "*.safetensors"
        raise ValueError(f"{files}: no weight {rename(missing[0], HF_NAMES)}{more} "
                         f"(config.json: {config.n_layer} layers, tie_word_embeddings {config.tie_embeddings})")
    if extra:
        raise ValueError(f"{where[extra[0]]}: weight {rename(extra[0], HF_NAMES)} is not in the model config.json "
                         "describes")
    for k, shape in want.items():
        if tuple(state[k].shape) != shape:
            raise ValueError(f"{where[k]}: {rename(k, HF_NAMES)} has shape {list(state[k].shape)}, config.json "
                             f"says {list(shape)}")


def block_size(path, c):
    """MARS's B when the directory is a MARS model: our export records it; the authors' names say blk4, blk8,
    blk16 (read from the path, e.g. a hub cache's models--Xalphinions--MARS-Qwen2.5-0.5B-blk8/...), else 4."""
    if "mars_block_size" in c:
        B = c["mars_block_size"]
        if isinstance(B, bool) or not isinstance(B, int) or B < 1:
            raise ValueError(f"config.json: mars_block_size must be an integer >= 1 (MARS's B), got {json.dumps(B)}")
        return B
    if c.get("model_type") == "a2d-qwen2":
        found = re.findall(r"blk(\d+)", os.path.abspath(path))
        return int(found[-1]) if found else 4
    return None


def read_tokenizer(path, n_rows):
    """The directory's tokenizer (extras/checkpoints/hf_tokenizer.from_hf), which must fit the model's n_rows embedding rows."""
    template = os.path.join(path, "chat_template.jinja")
    source = "chat_template.jinja" if os.path.isfile(template) else "tokenizer_config.json"
    try:
        text = open(template, encoding="utf-8").read() if os.path.isfile(template) else None
        tok = from_hf(read_json(path, "tokenizer.json"), read_json(path, "tokenizer_config.json", {}), text, n_rows)
    except ChatTemplateError as e:
        raise ValueError(f"{source}: {e}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{source}: not UTF-8 text ({e.reason})") from None
    except (KeyError, TypeError, AttributeError, IndexError) as e:
        raise ValueError(f"tokenizer.json: not a tokenizer this loader reads ({type(e).__name__}: {e})") from None
    if tok.n_vocab > n_rows:
        raise ValueError(f"config.json: vocab_size {n_rows} is smaller than the tokenizer's {tok.n_vocab} ids "
                         "(tokenizer.json)")
    return tok


def read_checkpoint(path, device="cpu", dtype=None):
    """A Hugging Face model directory as a checkpoint dict of this project:
    {"model", "model_config", "tokenizer", "stage": "hf", "hf": {"path", "model_type"}}, plus
    "mars": {"B"} for a MARS model. Weights in dtype (default float32), on device."""
    c = read_json(path, "config.json")
    config = config_from_hf(c)
    B = block_size(path, c)
    tok = read_tokenizer(path, config.vocab_size)
    state, where = read_weights(path, device, dtype or torch.float32)
    if config.tie_embeddings and "wte.weight" in state:
        state["lm_head.weight"], where["lm_head.weight"] = state["wte.weight"], where["wte.weight"]
    check_weights(state, where, config)
    ckpt = {"model": state, "model_config": asdict(config), "tokenizer": tok.state(), "stage": "hf",
            "hf": {"path": os.path.abspath(path), "model_type": c["model_type"]}}
    if B:
        ckpt["mars"] = {"B": B}
    return ckpt


def export(ckpt, out_dir):
    """Write a checkpoint dict (ours or read_checkpoint's) as a Hugging Face directory: config.json
    (model_type qwen2 with q/k/v biases, else llama; MARS's B as mars_block_size), model.safetensors,
    tokenizer.json and tokenizer_config.json (chat template, <|mask|> an added special token). Its pad
    token is <|pad|>, on the first row past the tokenizer (added when there is none): a stack that drops
    pad ids from attention must not drop a token of the prompt."""
    # HFTokenizer for the toy's too: to_hf reads a normal form and template variables
    config, tok = GPTConfig(**ckpt["model_config"]), HFTokenizer.from_state(ckpt["tokenizer"])
    pad = tok.specials.get(PAD, tok.n_vocab)
    weights = {k: v.detach().to("cpu") for k, v in ckpt["model"].items()}
    if pad >= config.vocab_size:  # a zero row: its embedding is never attended, its logit stays 0
        for k in ("wte.weight", "lm_head.weight"):
            weights[k] = torch.cat([weights[k], weights[k].new_zeros(pad + 1 - config.vocab_size, config.n_embd)])
        config.vocab_size = pad + 1
    kind = "qwen2" if config.qkv_bias else "llama"
    rope = {"rope_type": "default", "rope_theta": config.rope_base}
    hf_config = {
        "architectures": ["Qwen2ForCausalLM" if config.qkv_bias else "LlamaForCausalLM"], "model_type": kind,
        "vocab_size": config.vocab_size, "max_position_embeddings": config.max_seq_len,
        "num_hidden_layers": config.n_layer, "num_attention_heads": config.n_head, "hidden_size": config.n_embd,
        "num_key_value_heads": config.n_kv_head, "head_dim": config.head_dim,
        "intermediate_size": config.intermediate_size, "hidden_act": "silu", "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_base, "rope_parameters": rope, "rope_scaling": None,
        "tie_word_embeddings": config.tie_embeddings, "eos_token_id": tok.eot, "pad_token_id": pad,
        "torch_dtype": str(weights["wte.weight"].dtype).removeprefix("torch."), "use_cache": True,
        **({"use_sliding_window": False, "sliding_window": None} if config.qkv_bias else
           {"attention_bias": False, "mlp_bias": False}),
    }
    if "mars" in ckpt:
        hf_config["mars_block_size"] = ckpt["mars"]["B"]
    skip = {"lm_head.weight"} if config.tie_embeddings else set()
    weights = {rename(k, HF_NAMES): v.contiguous() for k, v in weights.items() if k not in skip}
    tokenizer_json, tokenizer_config = to_hf(tok, pad)
    tokenizer_config["model_max_length"] = config.max_seq_len
    os.makedirs(out_dir, exist_ok=True)
    save_file(weights, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    files = {"config.json": hf_config, "tokenizer.json": tokenizer_json, "tokenizer_config.json": tokenizer_config,
             "generation_config.json": {"eos_token_id": tok.eot, "pad_token_id": pad, "do_sample": False}}
    for name, obj in files.items():
        with open(os.path.join(out_dir, name), "w", encoding="utf-8") as f:
            json.dump(obj, f, ensure_ascii=False, indent=1)
