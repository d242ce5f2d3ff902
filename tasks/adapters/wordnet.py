"""WordNet's nouns as Debian's `wordnet-base` installs them (`/usr/share/wordnet`), read from its
database files (format: wndb(5WN)): a word's senses, each with its synonyms, definition and
hypernyms.

NLTK's reader is the usual one, but it wants the nltk_data layout (a `lexnames` file, and the
sense index of its own download to map versions), which Debian's package does not have; the two
files read here are all a description needs.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

WORDNET_DIR = Path("/usr/share/wordnet")
HYPERNYMS = ("@", "@i")  # pointer symbols of a hypernym and an instance hypernym


@dataclass(frozen=True)
class Synset:
    """One sense: its byte offset in `data.noun`, synonyms (spaces, not underscores), the
    definition (the gloss without its quoted examples) and the offsets of its hypernyms."""

    offset: int
    lemmas: tuple[str, ...]
    definition: str
    hypernyms: tuple[int, ...]


class WordNet:
    """The noun senses of WordNet's database in `root`."""

    def __init__(self, root: Path = WORDNET_DIR) -> None:
        self.root = Path(root)
        self.data = self.root / "data.noun"
        index = self.root / "index.noun"
        if not (self.data.is_file() and index.is_file()):
            raise FileNotFoundError(f"WordNet's noun database is not in {self.root} (Debian's "
                                    "package wordnet-base installs it: `make data`)")
        self._senses = _read_index(index)

    def synsets(self, word: str) -> list[Synset]:
        """The noun senses of `word` (any case, spaces or underscores), most frequent first."""
        key = word.strip().lower().replace(" ", "_")
        return [self.synset(offset) for offset in self._senses.get(key, ())]

    def synset(self, offset: int) -> Synset:
        with self.data.open("rb") as file:
            file.seek(offset)
            line = file.readline().decode("utf-8")
        return parse_data_line(line)


@functools.lru_cache(maxsize=2)
def _read_index(path: Path) -> dict[str, tuple[int, ...]]:
    senses = {}
    with path.open(encoding="utf-8") as file:
        for line in file:
            if line.startswith("  "):  # the licence at the top
                continue
            fields = line.split()
            count = int(fields[2])
            senses[fields[0]] = tuple(int(offset) for offset in fields[-count:])
    return senses


def parse_data_line(line: str) -> Synset:
    """One line of a data file: `offset lex_filenum ss_type w_cnt (word lex_id)... p_cnt
    (symbol offset pos source/target)... | gloss` (w_cnt in hexadecimal)."""
    head, _, gloss = line.partition(" | ")
    fields = head.split()
    words = int(fields[3], 16)
    lemmas = tuple(fields[4 + 2 * i].replace("_", " ") for i in range(words))
    first = 4 + 2 * words
    pointers = [fields[first + 1 + 4 * i: first + 5 + 4 * i] for i in range(int(fields[first]))]
    hypernyms = tuple(int(p[1]) for p in pointers if p[0] in HYPERNYMS)
    parts = [part.strip() for part in gloss.strip().split(";")]
    definition = "; ".join(p for p in parts if p and not p.startswith('"'))
    return Synset(int(fields[0]), lemmas, definition, hypernyms)
