"""The Hugging Face transformers peer every kiln benchmark measures beside kiln."""
from __future__ import annotations

import argparse
from pathlib import Path

import torch


def add_peer_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hf_gguf", help="GGUF file Hugging Face loads as the peer")
    parser.add_argument("--hf_dir", help="Hugging Face model directory as the peer (instead of --hf_gguf)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads for both")


def check_peer_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if not (args.hf_gguf or args.hf_dir):
        parser.error("give --hf_gguf or --hf_dir")
    torch.set_num_threads(args.threads)


def load_hf_peer(args: argparse.Namespace, dtype: str):
    """The peer model in ``dtype`` (a kiln dtype name), quiet and in eval mode."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    torch_dtype = getattr(torch, dtype)
    if args.hf_gguf:
        gguf = Path(args.hf_gguf)
        return AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch_dtype).eval()
    return AutoModelForCausalLM.from_pretrained(args.hf_dir, dtype=torch_dtype).eval()
