"""The `image_text` pieces against hand-worked values: the weighted multi-description
contrastive loss and what it never counts as a negative, the text-initialized classifier, the
head mixing, the text bank, the built-in tokens, WordNet's files, the measured phrases, the
description tables' checks, and what a few-label run gives its unlabelled images and its
choices."""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch

from models.image_text import PAD, build_image_text, tokens
from tasks.adapters.wordnet import WordNet, parse_data_line
from tasks.image_text.descriptions import image_keys, wordnet_classes
from training.image_text.descriptions import (
    DescriptionError,
    check_classes,
    check_images,
    image_measures,
    image_phrases,
    read_descriptions,
    tertiles,
)
from training.image_text.losses import (
    UNLABELLED,
    TextBank,
    agreement_weights,
    choose_mixing,
    class_text_weights,
    contrastive_loss,
    image_text_step,
    mixed_head,
)

# Two images, three texts: image 0 owns texts 0 (weight 1) and 1 (weight 0.5), image 1 owns
# text 2 (weight 1). Scale 1 (logit_scale 0): the logits are the cosines
#   image 0: [1, 0.6, 0]     image 1: [0, 0.8, 1]
IMAGES = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
TEXTS = torch.tensor([[1.0, 0.0], [0.6, 0.8], [0.0, 1.0]])
OWNER = torch.tensor([0, 0, 1])
WEIGHTS = torch.tensor([1.0, 0.5, 1.0])
SCALE = torch.tensor(0.0)


def nll(positive: float, *negatives: float) -> float:
    """-log(e^p / (e^p + sum e^n)), by hand."""
    return -math.log(math.exp(positive) / (math.exp(positive)
                                           + sum(math.exp(n) for n in negatives)))


def loss(labels=(UNLABELLED, UNLABELLED)) -> float:
    return float(contrastive_loss(IMAGES, TEXTS, OWNER, torch.tensor([0, 1, 2]), WEIGHTS,
                                  torch.tensor(labels), SCALE))


def test_contrastive_loss_by_hand():
    # image -> text: an image's other text is never a negative of its own texts
    image_side = (1 * nll(1, 0) + 0.5 * nll(0.6, 0) + 1 * nll(1, 0, 0.8)) / 2.5
    # text -> image: each text against the image that does not own it
    text_side = (1 * nll(1, 0) + 0.5 * nll(0.6, 0.8) + 1 * nll(1, 0)) / 2.5
    assert loss() == pytest.approx((image_side + text_side) / 2, rel=1e-6)


def test_a_text_both_images_carry_is_a_negative_of_neither():
    # image 1's text is text 0 again (same id, same vector): for image 0 nothing is left to
    # push away; image 1 pushes away text 1 only; text 0 has no negative image
    texts = torch.tensor([[1.0, 0.0], [0.6, 0.8], [1.0, 0.0]])  # logits: [1, .6, 1], [0, .8, 0]
    value = float(contrastive_loss(IMAGES, texts, OWNER, torch.tensor([0, 1, 0]), WEIGHTS,
                                   torch.tensor([UNLABELLED] * 2), SCALE))
    image_side = (1 * nll(1) + 0.5 * nll(0.6) + 1 * nll(0, 0.8)) / 2.5
    text_side = (1 * nll(1) + 0.5 * nll(0.6, 0.8) + 1 * nll(0)) / 2.5
    assert value == pytest.approx((image_side + text_side) / 2, rel=1e-6)


def test_known_classes_are_never_negatives_of_each_other():
    assert loss(labels=(3, 3)) == pytest.approx(0.0, abs=1e-7)  # nothing left to push away
    assert loss(labels=(3, 4)) == pytest.approx(loss())  # different classes: as unlabelled
    assert loss(labels=(3, UNLABELLED)) == pytest.approx(loss())  # one unknown: as unlabelled


def test_agreement_weights_follow_each_images_own_cosines_by_hand():
    # image 0's cosines with its texts 1 and 0.6: at temperature 0.1, 2 x e^10 / (e^10 + e^6)
    # and 2 x e^6 / (e^10 + e^6); image 1's only text keeps 1
    first = 2 * math.exp(10) / (math.exp(10) + math.exp(6))
    assert agreement_weights(IMAGES, TEXTS, OWNER, 0.1).tolist() == pytest.approx(
        [first, 2 - first, 1.0], rel=1e-5)
    # the loss weighs each row by its kind's weight times its agreement
    agreed = WEIGHTS * torch.tensor([first, 2 - first, 1.0])
    assert float(contrastive_loss(IMAGES, TEXTS, OWNER, torch.tensor([0, 1, 2]), WEIGHTS,
                                  torch.tensor([UNLABELLED] * 2), SCALE, 0.1)) == \
        pytest.approx(float(contrastive_loss(IMAGES, TEXTS, OWNER, torch.tensor([0, 1, 2]),
                                             agreed, torch.tensor([UNLABELLED] * 2), SCALE)))


def test_the_scale_is_clamped_at_100_and_gradients_are_finite():
    images = IMAGES.clone().requires_grad_()
    big = torch.tensor(10.0, requires_grad=True)  # e^10 > 100: used as 100
    value = contrastive_loss(images, TEXTS, OWNER, torch.tensor([0, 1, 2]), WEIGHTS,
                             torch.tensor([3, 3]), big)
    value.backward()
    assert torch.isfinite(images.grad).all() and big.grad == 0
    clamped = contrastive_loss(IMAGES, TEXTS, OWNER, torch.tensor([0, 1, 2]), WEIGHTS,
                               torch.tensor([UNLABELLED] * 2), torch.tensor(math.log(100)))
    assert float(clamped) == pytest.approx(float(contrastive_loss(
        IMAGES, TEXTS, OWNER, torch.tensor([0, 1, 2]), WEIGHTS,
        torch.tensor([UNLABELLED] * 2), torch.tensor(10.0))))


def test_class_weights_average_normalized_descriptions_as_wise_ft():
    features = torch.tensor([[2.0, 0.0], [0.0, 5.0], [0.0, -3.0]])
    weights = class_text_weights(features, torch.tensor([0, 0, 1]), 2, scale=10.0)
    half = 10 / math.sqrt(2)  # (1, 0) and (0, 1) averaged, renormalized, times 10
    assert weights.flatten().tolist() == pytest.approx([half, half, 0.0, -10.0])
    with pytest.raises(ValueError, match=r"no description for classes \[2\]"):
        class_text_weights(features, torch.tensor([0, 0, 1]), 3, scale=1.0)


def test_head_mixing_picks_the_alpha_with_the_best_validation_accuracy():
    # two classes; the trained head separates them along x, the zero-shot head along y, so
    # the mixed head predicts class 0 where alpha * x + (1 - alpha) * y > 0
    trained = torch.tensor([[1.0, 0.0], [0.0, 0.0]])
    zero_shot = torch.tensor([[0.0, 1.0], [0.0, 0.0]])
    assert mixed_head(trained, zero_shot, 0.25).tolist() == [[0.25, 0.75], [0.0, 0.0]]
    features = torch.tensor([[1.0, -0.5],  # class 0: right when alpha > 1/3
                             [-0.5, 1.0],  # class 0: right when alpha < 2/3
                             [-1.0, -1.0]])  # class 1: right at every alpha
    labels = torch.tensor([0, 0, 1])
    alpha, accuracies = choose_mixing(features, labels, trained, zero_shot)
    assert alpha == 0.5
    assert accuracies == pytest.approx({0.0: 2 / 3, 0.25: 2 / 3, 0.5: 1.0, 0.75: 2 / 3,
                                        1.0: 2 / 3})
    # ties go to the larger alpha: without the second image, 0.5, 0.75 and 1 are all right
    alpha, accuracies = choose_mixing(features[[0, 2]], labels[[0, 2]], trained, zero_shot)
    assert alpha == 1.0 and accuracies[0.5] == accuracies[1.0] == 1.0
    with pytest.raises(ValueError, match=r"alpha must be in \[0, 1\], got 1.5"):
        mixed_head(trained, zero_shot, 1.5)
    with pytest.raises(ValueError, match="the heads differ in shape"):
        mixed_head(trained, zero_shot[:1], 0.5)


def test_the_validation_images_of_a_few_label_run_hold_at_most_k_per_class():
    from tasks.image_text.tasks import validation_images

    labels = torch.tensor([0] * 6 + [1] * 2 + [2] * 5 + [0] * 3)
    val = torch.arange(6, 16)  # 3 of class 0, 2 of class 1, 5 of class 2
    keys = [f"img{n:02d}.png" for n in range(len(labels))]
    chosen = validation_images(labels, val, 3, 4, keys)
    assert set(chosen.tolist()) <= set(val.tolist()) and chosen.tolist() == sorted(chosen)
    assert torch.bincount(labels[chosen]).tolist() == [3, 2, 3]  # class 1 has only 2
    assert torch.equal(chosen, validation_images(labels, val, 3, 4, keys))  # the same
    assert torch.bincount(labels[validation_images(labels, val, 1, 5, keys)]).tolist() == \
        [1, 1, 1]
    assert torch.equal(validation_images(labels, val, None, 4, keys), val)  # every label: all


def test_own_captions_give_class_texts_to_the_labelled_images_only():
    from training.image_text.descriptions import own_captions

    classes = pd.DataFrame({"class": ["Bag", "Bag", "Coat", "Coat", "Coat"],
                            "text": ["a bag", "a kind of container", "a coat",
                                     "an outer garment", "a kind of garment"],
                            "weight": [1.0, 0.5, 1.0, 1.0, 0.5], "kind": ["name", "hypernym",
                                                                         "name", "definition",
                                                                         "hypernym"]})
    images = torch.randint(0, 255, (6, 1, 8, 8), dtype=torch.uint8,
                           generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([0, 1, 1, 0, 1, 0])
    every = own_captions(images, labels, torch.arange(6), classes, ["Bag", "Coat"], 1, True, 3)
    few = own_captions(images, labels, torch.arange(6), classes, ["Bag", "Coat"], 1, True, 3,
                       described=torch.tensor([1, 3]))
    class_rows = few[few["kind"] != "phrase"]
    assert sorted(set(class_rows["position"])) == [1, 3]  # the labelled images only ...
    assert set(few[few["position"].isin([0, 2, 4, 5])]["kind"]) == {"phrase"}
    assert len(few[few["kind"] == "phrase"]) == 12  # ... every image its two phrases
    same = every[every["position"].isin([1, 3])].reset_index(drop=True)
    assert same.equals(few[few["position"].isin([1, 3])].reset_index(drop=True))


def test_the_text_bank_gives_each_image_its_rows():
    bank = TextBank.build([2, 0, 2, 2], [7, 8, 9, 7], [1.0, 0.5, 0.25, 1.0], 4,
                          torch.zeros(10, 3))
    owner, text_ids, weights = bank.rows_of(torch.tensor([2, 1, 0]))
    assert owner.tolist() == [0, 0, 0, 2]  # image 1 has no text
    assert text_ids.tolist() == [7, 9, 7, 8] and weights.tolist() == [1.0, 0.25, 1.0, 0.5]


def test_the_step_adds_ce_on_labelled_images_only():
    torch.manual_seed(0)
    net = build_image_text("cnn2", 1, 3, 4, dim=8, text_dim=6).eval()  # BatchNorm as one
    bank = TextBank.build([0, 1, 2, 3], [0, 1, 2, 0], [1.0] * 4, 4, torch.randn(3, 6))
    x, y = torch.randn(4, 1, 28, 28), torch.tensor([0, 1, 2, 0])
    ids = torch.arange(4)
    labelled = torch.tensor([True, False, False, False])
    both = image_text_step(bank, labelled, 1.0, 2.0)(net, ids, x, y)
    expected_ce = torch.nn.functional.cross_entropy(net(x[:1]), y[:1])
    assert float(both["loss_ce"].detach()) == pytest.approx(float(expected_ce), rel=1e-5)
    assert float(both["loss"]) == pytest.approx(
        float(2 * both["loss_ce"] + both["loss_contrastive"]), rel=1e-5)
    align = image_text_step(bank, labelled, 1.0, 0.0)(net, ids, x, y)
    assert "loss_ce" not in align and float(align["loss"]) == pytest.approx(
        float(both["loss_contrastive"]), rel=1e-5)


def test_builtin_tokens_hash_words_and_pairs_and_pad():
    ids = tokens("A kind of SHOE", buckets=1000, length=10)
    assert len(ids) == 10 and ids[7:] == [PAD] * 3  # 4 words + 3 pairs
    assert ids == tokens("a kind of shoe!", buckets=1000, length=10)  # case, punctuation
    assert all(1 <= i <= 1000 for i in ids[:7])
    assert tokens("a b c", buckets=1000, length=2) == ids[:0] + tokens("a b", 1000, 2)[:2]


def test_a_wordnet_data_line_parses_by_hand():
    line = ("04199027 06 n 03 gym_shoe 0 sneaker 0 tennis_shoe 0 002 @ 04199000 n 0000 "
            "~ 03222222 n 0000 | a canvas shoe with a pliable rubber sole; \"an example\"  \n")
    synset = parse_data_line(line)
    assert synset.lemmas == ("gym shoe", "sneaker", "tennis shoe")
    assert synset.definition == "a canvas shoe with a pliable rubber sole"
    assert synset.hypernyms == (4199000,) and synset.offset == 4199027


def test_every_fashion_mnist_class_has_wordnet_descriptions():
    from torchvision.datasets import FashionMNIST

    table = wordnet_classes(list(FashionMNIST.classes))
    sneaker = table[table["class"] == "Sneaker"].set_index("kind")["text"]
    assert sneaker["definition"] == "a canvas shoe with a pliable rubber sole"
    assert sneaker["hypernym"] == "a kind of shoe"
    assert sneaker["synonyms"] == "gym shoe, sneaker, tennis shoe"
    boot = table[table["class"] == "Ankle boot"].set_index("kind")["text"]
    assert boot["definition"].startswith("footwear that covers the whole foot")
    assert set(table["class"]) == set(FashionMNIST.classes)
    with pytest.raises(DescriptionError, match="no noun for classes Zzyzxq"):
        wordnet_classes(["Sneaker", "Zzyzxq"], WordNet())


def test_image_measures_by_hand():
    image = torch.zeros(1, 1, 4, 4, dtype=torch.uint8)
    image[0, 0, 2:, :2] = 200  # a 2 x 2 block, bottom left
    measures = image_measures(image)
    assert float(measures["ink"][0]) == pytest.approx(0.25)
    assert float(measures["brightness"][0]) == pytest.approx(200 / 255)
    assert float(measures["aspect"][0]) == pytest.approx(1.0)
    assert float(measures["balance"][0]) == pytest.approx(2.5 / 3)  # rows 2 and 3 of 0..3
    assert float(measures["symmetry"][0]) == pytest.approx(0.0)  # its mirror misses it all
    image[0, 0, 2:, 2:] = 200  # now mirrored: a 4 x 2 bar along the bottom
    measures = image_measures(image)
    assert float(measures["symmetry"][0]) == pytest.approx(1.0)
    assert float(measures["aspect"][0]) == pytest.approx(2.0)
    cuts = {name: (0.0, 10.0) for name in measures}  # every value in the middle third
    assert image_phrases(measures, cuts) == [("a squarish, grey item filling half the frame",
                                              "a fairly symmetric shape, balanced")]
    assert tertiles({"ink": torch.tensor([0.0, 1.0, 2.0, 3.0])})["ink"] == pytest.approx(
        (1.0, 2.0))


def test_description_tables_refuse_bad_rows_naming_them(tmp_path):
    table = tmp_path / "captions.csv"
    pd.DataFrame({"image": ["1", "2", "3"], "text": ["a shoe", " ", "a bag"],
                  "weight": [1.0, 1.0, 2.0]}).to_csv(table, index=False)
    with pytest.raises(DescriptionError, match=r"1 rows with an empty text \(lines 3\)"):
        read_descriptions(str(table), "image")
    pd.DataFrame({"image": ["1", "2"], "text": ["a shoe", "a bag"],
                  "weight": [1.0, -0.5]}).to_csv(table, index=False)
    with pytest.raises(DescriptionError, match=r"negative or non-numeric weight \(lines 3\)"):
        read_descriptions(str(table), "image")
    pd.DataFrame({"picture": ["1"], "text": ["a shoe"]}).to_csv(table, index=False)
    with pytest.raises(DescriptionError, match="no column image"):
        read_descriptions(str(table), "image")
    parquet = tmp_path / "captions.parquet"
    pd.DataFrame({"image": ["0", "5"], "text": ["a shoe", "a bag"]}).to_parquet(parquet)
    frame = read_descriptions(str(parquet), "image")
    assert frame["weight"].tolist() == [1.0, 1.0]  # absent: 1
    with pytest.raises(DescriptionError, match=r"2 images not in the data set, e.g. 7, 9"):
        check_images(pd.DataFrame({"image": ["0", "9", "7"]}), ["0", "1", "2"], "t.csv")
    with pytest.raises(DescriptionError, match="no description for classes Bag"):
        check_classes(pd.DataFrame({"class": ["Shirt"]}), ["Shirt", "Bag"], "c.csv")


def test_image_keys_follow_the_folder_order(fashion_folder):
    keys = image_keys(str(fashion_folder))
    assert keys[0] == "Sneaker/img000.png" and len(keys) == 120
    assert keys == sorted(keys, key=lambda k: (k.split("/")[0], k))
    skipped = [str(fashion_folder / "Trouser" / "img001.jpg")]
    assert "Trouser/img001.jpg" not in image_keys(str(fashion_folder), skipped)


def test_a_shifted_resized_recompressed_copy_matches_and_a_flip_too():
    from PIL import Image

    from training.image_text.matching import NO_MATCH, match, precision_recall, signatures

    original = Image.new("L", (28, 28))
    original.paste(200, (6, 4, 14, 24))  # a bar left of centre
    original.paste(90, (14, 4, 22, 10))  # and a lighter arm at the top right
    copy = original.transform((28, 28), Image.Transform.AFFINE, (1, 0, -2, 0, 1, 1))
    copy = copy.resize((50, 50), Image.Resampling.BILINEAR)  # shifted, then resized
    mirrored = original.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    other = Image.new("L", (28, 28))
    other.paste(200, (4, 12, 24, 16))  # a horizontal bar
    queries = signatures([original, mirrored, other])
    pool = [copy, other.rotate(90)]
    found, best = match(queries, signatures(pool), signatures(pool, mirrored=True), 0.9, 0.02)
    assert found.tolist()[:2] == [0, 0] and float(best[0]) > 0.95  # the copy, flipped or not
    assert found.tolist()[2] == NO_MATCH  # a bar is not its rotated self
    # precision and recall by hand: 2 matches made, 1 right; 2 true matches present
    figures = precision_recall(torch.tensor([3, 5, NO_MATCH, NO_MATCH]),
                               torch.tensor([3, 4, 7, NO_MATCH]))
    assert figures == {"precision": 0.5, "recall": 1 / 3, "matched": 2, "true_matches": 3}


def test_a_look_alike_within_the_margin_is_no_match():
    from training.image_text.matching import NO_MATCH, match

    pool = torch.nn.functional.normalize(torch.tensor([[1.0, 0.0, 0.0], [1.0, 0.1, 0.0]]), dim=1)
    query = torch.tensor([[1.0, 0.0, 0.0]])
    found, _ = match(query, pool, pool, threshold=0.9, margin=0.02)  # cosines 1 and 0.995
    assert found.tolist() == [NO_MATCH]
    found, _ = match(query, pool, pool, threshold=0.9, margin=0.001)
    assert found.tolist() == [0]


def test_the_vocabulary_encodes_and_decodes_by_hand():
    from training.image_text.captioner import BOS, EOS, UNK, Vocabulary
    from training.image_text.captioner import PAD as CAPTION_PAD

    vocabulary = Vocabulary(["a shoe, a boot", "a bag"])
    assert vocabulary.itos[4:] == ["a", ",", "bag", "boot", "shoe"]  # by count, then a-z
    assert vocabulary.encode("A boot, a hat", 8) == [BOS, 4, 7, 5, 4, UNK, EOS, CAPTION_PAD]
    assert vocabulary.encode("a shoe a bag a boot", 4) == [BOS, 4, 8, EOS]  # cut, EOS kept
    assert vocabulary.decode([4, 8, 5, 4, 7, EOS, 6]) == "a shoe, a boot"


def test_the_caption_loss_weights_captions_and_skips_padding():
    from training.image_text.captioner import caption_loss

    ids = torch.tensor([[1, 4, 2, 0], [1, 5, 6, 2]])  # BOS a EOS PAD; BOS b c EOS
    logits = torch.zeros(2, 3, 7)
    logits[0, 0, 4] = math.log(3.0)  # p(a) = 3 / 9 with six others at 1
    per_word_0 = [-math.log(3 / 9), -math.log(1 / 7)]  # a, then EOS (all alike)
    per_word_1 = [-math.log(1 / 7)] * 3
    weights = torch.tensor([1.0, 3.0])
    expected = (sum(per_word_0) / 2 * 1 + sum(per_word_1) / 3 * 3) / 4
    assert float(caption_loss(logits, ids, weights)) == pytest.approx(expected, rel=1e-6)


def test_generation_stops_at_eos_and_pads_after_it():
    from training.image_text.captioner import EOS, Captioner

    torch.manual_seed(0)
    model = Captioner(torch.nn.Flatten(), 4, 6, embed_dim=3, hidden=5)
    with torch.no_grad():
        model.out.weight.zero_()
        model.out.bias.copy_(torch.tensor([0.0, 0, 0, 0, 1, 0]))  # word 4 first ...
    first = model.generate(torch.ones(2, 1, 2, 2), 5)
    assert first.tolist() == [[4] * 4] * 2  # ... and never EOS: cut at length - 1
    with torch.no_grad():
        model.out.bias.copy_(torch.tensor([0.0, 0, 5, 0, 0, 0]))  # EOS at once
    assert model.generate(torch.ones(2, 1, 2, 2), 5).tolist() == [[EOS], [EOS]]


def test_bleu_takes_any_number_of_references_per_image():
    from training.image_text.captioner import bleu

    assert bleu(["a canvas shoe with a rubber sole"],
                [["a canvas shoe with a rubber sole"]]) == pytest.approx(100.0)
    one = bleu(["a shoe with a rubber sole", "a bag"], [["a shoe with a rubber sole"], ["a sack"]])
    more = bleu(["a shoe with a rubber sole", "a bag"],
                [["a shoe with a rubber sole"], ["a sack", "a bag"]])
    assert more > one  # a second reference that the hypothesis matches counts
