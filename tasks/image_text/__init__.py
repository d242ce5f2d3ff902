"""The `image_text` flow's tasks: `tasks` (describe, encode, train a round, mix the heads,
test and export), `descriptions` (the project's and the user's descriptions of images and
classes), `pool` (descriptions matched from a pool of image-text pairs), `captioner` (the
captioner that describes the rest) and `evaluation` (zero-shot and recognition tests)."""
