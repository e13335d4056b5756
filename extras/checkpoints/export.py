"""Any checkpoint that extras/checkpoints/foreign.py reads (ours, or a real model's) written as
a Hugging Face directory that transformers loads as Qwen2ForCausalLM or LlamaForCausalLM
(extras/checkpoints/hf.py: export):

    python -m extras.checkpoints.export out/mars.pt hf_out      # then AutoModelForCausalLM.from_pretrained("hf_out")
"""
from common import Parser, run_cli
from extras.checkpoints import foreign
from extras.checkpoints.hf import export


def main(argv=None):
    p = Parser(__doc__)
    p.add_argument("ckpt", help="our checkpoint (.pt), a Hugging Face directory, or a GGUF file (or smollm2)")
    p.add_argument("out_dir", help="the Hugging Face directory to write")
    args = p.parse_args(argv)
    ckpt, model, _ = foreign.load(args.ckpt)
    # the weights under this version's names, whichever version wrote them
    export({**ckpt, "model": model.state_dict()}, args.out_dir)
    print(f"wrote {args.out_dir}")


if __name__ == "__main__":
    run_cli(main)
