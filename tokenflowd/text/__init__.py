"""Text, on the front's side of the token-id boundary, with no torch import:

    tokenizer.py   Tokenizer: byte-level BPE from GGUF metadata or tokenizer.json, the chat template
    stream.py      IncrementalDetokenizer (ids -> UTF-8-safe text pieces), StopStringMatcher
    source.py      which model a spec names, and its tokenizer, without loading weights
"""
