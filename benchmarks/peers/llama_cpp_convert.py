"""Convert a bench model directory to GGUF with llama.cpp's own converter.

    python llama_cpp_convert.py LLAMA_CPP_SOURCE MODEL_DIR --outtype f32 --outfile M.gguf

LLAMA_CPP_SOURCE is the llama.cpp tree holding `convert_hf_to_gguf.py`,
`conversion/` and `gguf-py/`. The converter runs unchanged but for two
lookups the bench models need answered (their tokenizer is a byte-level BPE
trained for the benchmarks, see model_dirs.train_tokenizer):

- the SentencePiece attempt: a directory without `tokenizer.model` is not a
  SentencePiece model, said before `sentencepiece` is imported (it need not be
  installed);
- the BPE pre-tokenizer, which the converter knows by the hash of a test
  string's tokens: a tokenizer whose pre-tokenizer is GPT-2's byte-level split
  alone is declared `gpt-2`, the pre-tokenizer it is. Any other unknown one
  still fails as the converter makes it fail.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def byte_level_only(model_dir: Path) -> bool:
    """Whether the directory's tokenizer.json pre-tokenizes with GPT-2's byte-level split alone."""
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        return False
    pre = json.loads(path.read_text()).get("pre_tokenizer") or {}
    return pre.get("type") == "ByteLevel" and pre.get("use_regex", True)


def patch(base) -> None:
    text_model = base.TextModel
    create_sentencepiece = text_model._create_vocab_sentencepiece
    vocab_base_pre = text_model.get_vocab_base_pre

    def _create_vocab_sentencepiece(self):
        if not (self.dir_model / "tokenizer.model").is_file():
            raise FileNotFoundError(f"File not found: {self.dir_model / 'tokenizer.model'}")
        return create_sentencepiece(self)

    def get_vocab_base_pre(self, tokenizer) -> str:
        try:
            return vocab_base_pre(self, tokenizer)
        except NotImplementedError:
            if byte_level_only(Path(self.dir_model)):
                return "gpt-2"
            raise

    text_model._create_vocab_sentencepiece = _create_vocab_sentencepiece
    text_model.get_vocab_base_pre = get_vocab_base_pre


def main() -> None:
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    source = Path(sys.argv[1]).resolve()
    if not (source / "convert_hf_to_gguf.py").is_file():
        raise SystemExit(f"{source} holds no convert_hf_to_gguf.py: give the llama.cpp source tree")
    sys.path[:0] = [str(source), str(source / "gguf-py")]
    import convert_hf_to_gguf
    from conversion import base

    patch(base)
    sys.argv = [str(source / "convert_hf_to_gguf.py"), *sys.argv[2:]]
    convert_hf_to_gguf.main()


if __name__ == "__main__":
    main()
