"""k-NN recognition against hand-computed votes, and the embedding the exported program keeps."""

import pytest
import torch

from models import build_model
from training.features import FeatureHooks, WithEmbedding, embedding_layer
from training.recognition import knn_accuracy, knn_classify


def test_votes_are_weighted_by_cosine_similarity():
    # gallery on the unit circle: two of class 0 near the x axis, one of class 1 on the y axis
    gallery = torch.tensor([[1.0, 0.0], [0.8, 0.6], [0.0, 2.0]])  # lengths do not matter
    labels = torch.tensor([0, 0, 1])
    queries = torch.tensor([[0.6, 0.8], [0.0, 1.0]])
    # query 0: cos = 0.6, 0.96, 0.8 -> k=1: gallery 1 (class 0); k=2: class 0 (0.96) beats
    #   class 1 (0.8); k=3: class 0 scores 0.6 + 0.96 = 1.56 against 0.8
    # query 1: cos = 0.0, 0.6, 1.0 -> k=1: class 1; k=3: class 0 scores 0.0 + 0.6 < 1.0
    predicted, nearest = knn_classify(gallery, labels, queries, k=1)
    assert predicted.tolist() == [0, 1]
    assert nearest.tolist() == pytest.approx([0.96, 1.0])
    assert knn_classify(gallery, labels, queries, k=2)[0].tolist() == [0, 1]
    assert knn_classify(gallery, labels, queries, k=3)[0].tolist() == [0, 1]
    # a weighted vote, not a count: two far class-0 neighbours lose to one close class-1
    far = torch.tensor([[1.0, 0.0], [1.0, 0.05], [0.6, 0.8]])
    assert knn_classify(far, torch.tensor([0, 0, 1]), torch.tensor([[0.0, 1.0]]),
                        k=3)[0].tolist() == [1]

def test_ties_go_to_the_lower_class_and_chunks_do_not_change_results():
    gallery = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    labels = torch.tensor([1, 0])
    query = torch.tensor([[1.0, 1.0]])  # equally close to both
    assert knn_classify(gallery, labels, query, k=2)[0].tolist() == [0]
    generator = torch.Generator().manual_seed(0)
    gallery = torch.randn(50, 8, generator=generator)
    labels = torch.randint(0, 4, (50,), generator=generator)
    queries = torch.randn(33, 8, generator=generator)
    whole = knn_classify(gallery, labels, queries, k=5)
    chunked = knn_classify(gallery, labels, queries, k=5, chunk=7)
    assert torch.equal(whole[0], chunked[0]) and torch.allclose(whole[1], chunked[1])
    assert knn_accuracy(gallery, labels, gallery, labels, k=1) == 1.0  # each is its own nearest


def test_bad_shapes_and_k_are_named():
    gallery, labels = torch.zeros(4, 3), torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match="same D"):
        knn_classify(gallery, labels, torch.zeros(2, 5), k=1)
    with pytest.raises(ValueError, match="k=5"):
        knn_classify(gallery, labels, torch.zeros(2, 3), k=5)
    with pytest.raises(ValueError, match="3 labels for 4"):
        knn_classify(gallery, labels[:3], torch.zeros(2, 3), k=1)


def test_exported_program_returns_logits_and_the_pooled_embedding(tmp_path):
    torch.manual_seed(0)
    model = build_model("cnn2", in_channels=1, num_classes=10).eval()
    x = torch.randn(3, 1, 28, 28)
    batch = torch.export.Dim("batch", min=1, max=1024)
    program = torch.export.export(WithEmbedding(model).eval(), (torch.zeros(2, 1, 28, 28),),
                                  dynamic_shapes=({0: batch},))
    torch.export.save(program, str(tmp_path / "p.pt2"))
    logits, embedding = torch.export.load(str(tmp_path / "p.pt2")).module()(x)
    with FeatureHooks(model, [embedding_layer(model)]) as hooks:
        expected_logits = model(x)
    assert torch.allclose(logits, expected_logits, atol=1e-5)
    assert torch.allclose(embedding, hooks["pool"].flatten(1), atol=1e-5)
    assert embedding.shape == (3, model.fc.in_features)
