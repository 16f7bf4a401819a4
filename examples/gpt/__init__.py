"""A nanoGPT-sized GPT trained with tensor parallelism x ZeRO-2 (see README.md here).

Run from the repository root: ``python -m examples.gpt.train --help``.
"""
