"""Compiled fast paths (``mx.compile``) over whole claimed subgraphs."""
from __future__ import annotations


def make_runner(program, options, stats=None):
    """The object a compute info calls ``run(inputs)`` on: the eager program for now."""
    return program
