"""A small captioner: a GRU decoder on an image network's features (pure torch).

The `image_text` flow's third source of descriptions: trained on the images that have
descriptions (teacher forcing, each description weighted), it writes one for each image that
has none (greedy decoding). `Vocabulary` holds the words of the training descriptions.
`undescribed` says which images it describes (a measured phrase alone does not count), `bleu`
how well its captions match held-out references.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence

import pandas as pd
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from training.batches import Normalize

SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")
PAD, BOS, EOS, UNK = range(4)


def words(text: str) -> list[str]:
    """A text's lower-case words and commas, in order."""
    return re.findall(r"[a-z0-9]+|,", text.lower())


def detokenize(tokens: Sequence[str]) -> str:
    """Words joined by spaces, commas attached to the word before."""
    return " ".join(tokens).replace(" ,", ",")


class Vocabulary:
    """Word ids: the specials, then every word seen at least `min_count` times (most frequent
    first, ties alphabetical, so the same texts give the same ids)."""

    def __init__(self, texts: Sequence[str], min_count: int = 1) -> None:
        counts = Counter(w for text in texts for w in words(text))
        kept = sorted((w for w, n in counts.items() if n >= min_count),
                      key=lambda w: (-counts[w], w))
        self.itos = [*SPECIALS, *kept]
        self.stoi = {w: i for i, w in enumerate(self.itos)}

    def __len__(self) -> int:
        return len(self.itos)

    def encode(self, text: str, length: int) -> list[int]:
        """`BOS`, the word ids (`UNK` for unknown words), `EOS`, cut to `length` and padded."""
        ids = [BOS, *(self.stoi.get(w, UNK) for w in words(text))][:length - 1] + [EOS]
        return ids + [PAD] * (length - len(ids))

    def decode(self, ids: Sequence[int]) -> str:
        """The text of generated ids, up to the first `EOS` (specials left out)."""
        out = []
        for i in ids:
            if i == EOS:
                break
            if i >= len(SPECIALS):
                out.append(self.itos[i])
        return detokenize(out)


class Captioner(nn.Module):
    """`encoder` (images to `feature_dim` values) starts a GRU's state; the GRU reads the
    caption so far (word embeddings beside the image features at every step) and predicts the
    next word."""

    def __init__(self, encoder: nn.Module, feature_dim: int, vocab_size: int,
                 embed_dim: int = 64, hidden: int = 256) -> None:
        super().__init__()
        self.encoder = encoder
        self.start = nn.Linear(feature_dim, hidden)
        self.embed = nn.Embedding(vocab_size, embed_dim, padding_idx=PAD)
        self.gru = nn.GRU(embed_dim + feature_dim, hidden, batch_first=True)
        self.out = nn.Linear(hidden, vocab_size)

    def _step_inputs(self, ids: Tensor, features: Tensor) -> Tensor:
        embedded = self.embed(ids)
        return torch.cat([embedded, features.unsqueeze(1).expand(-1, ids.shape[1], -1)], dim=2)

    def forward(self, images: Tensor, ids: Tensor) -> Tensor:
        """Next-word logits (N x (L - 1) x V) for captions `ids` (N x L, from `BOS`)."""
        features = self.encoder(images)
        state = torch.tanh(self.start(features)).unsqueeze(0)
        out, _ = self.gru(self._step_inputs(ids[:, :-1], features), state)
        return self.out(out)

    @torch.no_grad()
    def generate(self, images: Tensor, length: int) -> Tensor:
        """Greedy captions (N x up to `length` - 1 word ids, without `BOS`)."""
        features = self.encoder(images)
        state = torch.tanh(self.start(features)).unsqueeze(0)
        current = torch.full((len(images), 1), BOS, dtype=torch.long, device=images.device)
        generated = []
        done = torch.zeros(len(images), dtype=torch.bool, device=images.device)
        for _ in range(length - 1):
            out, state = self.gru(self._step_inputs(current, features), state)
            current = self.out(out[:, -1]).argmax(1, keepdim=True)
            current[done] = PAD
            generated.append(current)
            done |= current.squeeze(1) == EOS
            if bool(done.all()):
                break
        return torch.cat(generated, dim=1)


def caption_loss(logits: Tensor, ids: Tensor, weights: Tensor) -> Tensor:
    """Each caption's mean next-word cross-entropy (padding left out), weighted by its
    description's weight, averaged over the weights."""
    targets = ids[:, 1:]
    per_word = F.cross_entropy(logits.transpose(1, 2), targets, ignore_index=PAD,
                               reduction="none")
    mask = (targets != PAD).float()
    per_caption = (per_word * mask).sum(1) / mask.sum(1).clamp(min=1)
    return (per_caption * weights).sum() / weights.sum().clamp(min=1e-12)


CAPTION_LENGTH = 24  # words per caption, BOS and EOS included
BATCH = 128


def fit_captions(model: Captioner, images: Tensor, positions: Sequence[int],
                 texts: Sequence[str], weights: Sequence[float], vocabulary: Vocabulary,
                 normalize: Normalize, steps: int, seed: int, device: torch.device) -> None:
    """`steps` Adam steps of teacher forcing on shuffled (image, description) rows (the image
    at `positions[i]` of `images`, `texts[i]`), each description's loss weighted by
    `weights[i]`; the learning rate decays to 0 (cosine)."""
    count = len(texts)
    positions = torch.tensor(list(positions), dtype=torch.long)
    ids = torch.tensor([vocabulary.encode(t, CAPTION_LENGTH) for t in texts])
    weights = torch.tensor(list(weights), dtype=torch.float32)
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps)
    generator = torch.Generator().manual_seed(seed + 37)
    model.train()
    order, cursor = torch.randperm(count, generator=generator), 0
    for _ in range(steps):
        if cursor + BATCH > len(order):
            order, cursor = torch.randperm(count, generator=generator), 0
        batch = order[cursor:cursor + BATCH]
        cursor += BATCH
        x = normalize(images[positions[batch]].to(device))
        y = ids[batch].to(device)
        loss = caption_loss(model(x, y), y, weights[batch].to(device))
        if not torch.isfinite(loss):
            raise FloatingPointError(f"the captioner's loss is {loss.item()}: lower "
                                     "--caption-steps or check the descriptions")
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
        optimizer.step()
        schedule.step()


def write_captions(model: Captioner, images: Tensor, positions: Tensor, vocabulary: Vocabulary,
                   normalize: Normalize, device: torch.device) -> list[str]:
    """The captioner's greedy description of each image at `positions`."""
    model.eval()
    texts = []
    for start in range(0, len(positions), 1024):
        x = normalize(images[positions[start:start + 1024]].to(device))
        texts += [vocabulary.decode(row) for row in model.generate(x, CAPTION_LENGTH).tolist()]
    return texts


def bleu(hypotheses: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    """Corpus BLEU (sacrebleu, 0-100) of one hypothesis per image against that image's
    references (any number per image). sacrebleu is imported here, not with the module:
    training/ ships in a registered model's code and sacrebleu is no serving package."""
    import sacrebleu

    most = max(len(r) for r in references)
    streams = [[r[i] if i < len(r) else None for r in references] for i in range(most)]
    return float(sacrebleu.corpus_bleu(list(hypotheses), streams).score)


LOOKS_ONLY = frozenset({"phrase"})  # kinds that say how an image looks, not what it shows


def described_positions(captions: pd.DataFrame) -> Tensor:
    """The positions with a description that says what the image shows: a row of any kind
    but a measured phrase (`LOOKS_ONLY`)."""
    shows = captions[~captions["kind"].isin(LOOKS_ONLY)]
    return torch.tensor(sorted(set(shows["position"].tolist())), dtype=torch.long)


def undescribed(train: Tensor, captions: pd.DataFrame) -> Tensor:
    """The training positions without a description (`described_positions`: measured
    phrases alone do not count, so a few-label run's unlabelled images, which have only their
    phrases, are the captioner's to describe)."""
    return train[~torch.isin(train, described_positions(captions))]
