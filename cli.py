"""Command-line conventions every tool of the project shares: a user's mistake is one line
on stderr and a non-zero exit, never a traceback."""
import argparse
import os
import sys

import torch


class UserError(Exception):
    """A problem the user can fix: reported as one line, exit code 1."""


def run_cli(main):
    """Run a command-line main: a user's mistake becomes one line on stderr and exit 1."""
    try:
        main()
    except BrokenPipeError:  # the reader left (e.g. `| head`): nothing more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
    except (UserError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)


class Parser(argparse.ArgumentParser):
    """argparse whose errors are one line, for every CLI of the project."""

    def __init__(self, doc):
        super().__init__(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)

    def error(self, message):
        self.exit(2, f"error: {message} (see --help)\n")


def check_device(device):
    """UserError unless torch can place tensors on this device here (e.g. cuda without a GPU)."""
    try:
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError, ValueError):
        raise UserError(f"device {device!r} is not available on this machine") from None
