"""Configs and the command line: bad values stop before any work, naming the field."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from flows.cli import main
from flows.commands import COMMANDS
from tasks.configs.pbt import PBTConfig
from tasks.configs.train import TrainConfig
from tests.conftest import subprocess_env

ROOT = Path(__file__).resolve().parents[1]


def test_profile_fills_only_what_is_not_given():
    smoke = TrainConfig(profile="smoke", rounds=3)
    assert (smoke.network.model, smoke.dataset.train_limit, smoke.rounds) == ("cnn2", 512, 3)
    quick = TrainConfig()
    assert (quick.rounds, quick.dataset.train_limit, quick.network.model) == (8, 20000, "resnet18")


def test_flat_and_nested_input_give_one_config_and_the_profile_fills_a_partial_section():
    flat = TrainConfig(profile="smoke", lr=0.2, train_limit=300, model_name="shop")
    nested = TrainConfig(profile="smoke", optim={"lr": 0.2}, dataset={"train_limit": 300},
                         run={"model_name": "shop"})
    assert flat == nested
    assert (nested.optim.batch_size, nested.dataset.test_limit, nested.run.registry) == \
        (64, 256, False)  # the smoke profile's, beside the given fields of the same sections
    assert flat.flat()["lr"] == 0.2 and "optim" not in flat.flat()


def test_replace_validates_and_refuses_a_name_no_section_has():
    config = TrainConfig(profile="smoke")
    changed = config.replace(lr=0.3, rounds=2, seed=4)
    assert (changed.optim.lr, changed.rounds, changed.run.seed) == (0.3, 2, 4)
    assert changed.dataset is config.dataset  # untouched sections are not validated again
    with pytest.raises(ValueError, match="no field learning_rate"):
        config.replace(learning_rate=0.1)
    with pytest.raises(ValidationError, match="lr"):
        config.replace(lr=-1.0)


def test_former_names_still_configure_for_one_release_with_a_warning_naming_the_new():
    """`epochs` counted rounds and is `rounds` now (an epoch is one pass over the training
    images): the old names, flat, nested, prefixed or in `replace`, set the new fields."""
    from tasks.configs.pipeline import PipelineConfig
    from tasks.configs.sections import FormerNameWarning

    with pytest.warns(FormerNameWarning, match="epochs is now rounds"):
        old = TrainConfig(profile="smoke", epochs=3, optim={"warmup_epochs": 0.5})
    assert old == TrainConfig(profile="smoke", rounds=3, warmup_rounds=0.5)
    with pytest.warns(FormerNameWarning, match="epochs is now rounds"):
        assert old.replace(epochs=2).rounds == 2
    with pytest.warns(FormerNameWarning, match="pbt_round_epochs is now pbt_stage_rounds"):
        pipeline = PipelineConfig(profile="smoke", pbt_round_epochs=2, sparse_epochs=3,
                                  teacher_pretrain_epochs=1)
    assert (pipeline.pbt.stage_rounds, pipeline.sparse.rounds,
            pipeline.teacher_pretrain_rounds) == (2, 3, 1)
    with pytest.raises(ValidationError, match="epochs is the former name of rounds"):
        TrainConfig(epochs=3, rounds=4)


def test_a_former_flag_sets_the_new_field_with_a_notice_and_stays_out_of_the_help(capsys):
    from flows.cli import make_parser

    parser, _ = make_parser(COMMANDS, "pipeline")
    args = parser.parse_args(["pipeline", "--sparse-epochs", "3", "--warmup-epochs", "1"])
    assert (args.sparse_rounds, args.warmup_rounds) == ("3", "1")
    err = capsys.readouterr().err
    assert "notice: --sparse-epochs is now --sparse-rounds" in err
    assert "notice: --warmup-epochs is now --warmup-rounds" in err
    with pytest.raises(SystemExit):
        parser.parse_args(["pipeline", "--help"])
    out = capsys.readouterr().out
    assert "--sparse-rounds" in out and "--sparse-epochs" not in out


def test_a_field_name_in_two_sections_is_refused_when_the_class_is_made():
    from tasks.configs.sections import ProfiledConfig

    with pytest.raises(TypeError, match="'seed' of section 'run' is also in the config"):
        class Clashing(ProfiledConfig):
            seed: int = 0


def test_a_prefixed_section_takes_its_flat_names_and_two_sections_may_share_a_field_name(
        capsys):
    from tasks.configs.pipeline import PipelineConfig

    # `stages` is distillation's, `pbt_stages` the PBT step's; the profile presets by flat name
    config = PipelineConfig(profile="smoke", stages=3, pbt_stages=2, sparse_lr=0.02)
    assert (config.stages, config.pbt.stages, config.pbt.members, config.sparse.lr) == \
        (3, 2, 2, 0.02)
    assert config.pbt_config().stages == 2 and config.sparsify_config().optim.lr == 0.02
    assert PipelineConfig(profile="smoke", stages=3, pbt={"stages": 2},
                          sparse={"lr": 0.02}) == config  # nested input, as Prefect's form
    flat = config.flat()
    assert (flat["pbt_stages"], flat["stages"], flat["sparse_lr"]) == (2, 3, 0.02)
    assert "pbt" not in flat and "members" not in flat
    assert config.replace(pbt_members=5).pbt.members == 5
    with pytest.raises(ValueError, match="no field pbt_lr"):
        config.replace(pbt_lr=0.1)
    # the bounds and descriptions come from the PBT flow's own field
    assert PipelineConfig.flat_fields()["pbt_members"].description == \
        PBTConfig.model_fields["members"].description
    with pytest.raises(SystemExit):
        main(COMMANDS, ["pipeline", "--pbt-members", "1"])
    assert "pbt_members: Input should be greater than or equal to 2" in capsys.readouterr().err


def test_mlflow_names_belong_to_the_project_and_a_given_model_name_is_kept(monkeypatch):
    """The project's name is committed (project.env), never the clone's folder name: two
    clones in differently named folders write one registry. A --model-name is registered as
    given, unless a --project is given with it."""
    from tasks.adapters.prediction import PredictConfig
    from tasks.environment import read_env_file

    run = TrainConfig(project="team-a").run
    assert (run.experiment("train"), run.registered_name("train")) == ("team-a-train",) * 2
    assert TrainConfig(project="team-a", model_name="shop").run.registered_name("train") == \
        "team-a-shop"
    assert PredictConfig(images=str(ROOT), project="team-a").model_uri() == \
        "models:/team-a-pipeline@champion"
    committed = read_env_file()["COMPACTML_PROJECT"]
    assert committed == "compactml"
    monkeypatch.setenv("COMPACTML_PROJECT", committed)  # what project.env sets for a user
    assert TrainConfig().run.registered_name("pipeline") == "compactml-pipeline"
    assert TrainConfig(model_name="shop").run.registered_name("train") == "shop"
    assert PredictConfig(images=str(ROOT), model_name="shop").model_uri() == \
        "models:/shop@champion"
    assert PredictConfig(images=str(ROOT)).model_uri() == "models:/compactml-pipeline@champion"
    monkeypatch.delenv("COMPACTML_PROJECT")  # nothing set at all: still not the folder's name
    assert TrainConfig().run.registered_name("pipeline") == "compactml-pipeline"
    monkeypatch.setenv("COMPACTML_PROJECT", "")  # as the tests' own stores have it
    assert TrainConfig().run.registered_name("pipeline") == "pipeline"
    with pytest.raises(ValidationError, match="project"):
        TrainConfig(project="a/b")


@pytest.mark.parametrize(("values", "field"), [
    ({"lr": -0.1}, "lr"),
    ({"learning_rate": 0.1}, "learning_rate"),
    ({"data": "/no/such/folder"}, "data"),
    ({"model": "vgg11"}, "model"),
    ({"channels": 2}, "channels"),
    ({"model_name": "bad name!"}, "model_name"),
])
def test_bad_config_names_the_field(values, field):
    with pytest.raises(ValidationError) as error:
        TrainConfig(**values)
    assert [e["loc"][-1] for e in error.value.errors()] == [field]


def test_cli_rejects_bad_values_before_any_work(capsys):
    with pytest.raises(SystemExit) as stop:
        main(COMMANDS, ["train", "--lr", "-1", "--data", "/no/such/folder"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "lr: Input should be greater than 0" in err and "no such dataset directory" in err


def test_cli_help_lists_flows_and_parameters():
    out = subprocess.run([sys.executable, "-m", "flows", "train", "--help"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    for option in ("--profile", "--data", "--model", "--lr", "--model-name", "--skip-bad-images"):
        assert option in out
    top = subprocess.run([sys.executable, "-m", "flows", "--help"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    assert "train" in top and "prepare-data" in top


def test_top_level_help_imports_no_heavy_package():
    # `python -m flows --help` must not import the training stack (it took 17 s when it did)
    probe = ("import sys\nfrom flows.cli import main\nfrom flows.commands import COMMANDS\n"
             "try:\n    main(COMMANDS, ['--help'])\nexcept SystemExit:\n    pass\n"
             "print([m for m in ('torch', 'prefect', 'mlflow', 'dvc') if m in sys.modules])")
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True,
                          text=True, check=True)
    assert "image-text" in done.stdout and done.stdout.strip().endswith("[]")


@pytest.mark.parametrize(("argv", "message"), [
    (["train", "--round", "2"], "unrecognized arguments: --round 2 (did you mean --rounds?)"),
    (["train", "--epoch", "2"], "unrecognized arguments: --epoch 2 (did you mean --rounds?)"),
    (["train", "--modle", "lenet"], "(did you mean --model?)"),
    (["trian"], "unknown command 'trian' (did you mean train?)"),
    (["distill", "--student", "lenet"], "(did you mean --student-model or --student-width"),
])
def test_abbreviations_and_typos_stop_with_the_closest_name(argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        main(COMMANDS, argv)
    assert stop.value.code == 2
    assert message in capsys.readouterr().err


def test_required_options_say_so_in_the_help(capsys):
    with pytest.raises(SystemExit):
        main(COMMANDS, ["predict", "--help"])
    out = capsys.readouterr().out
    assert "PydanticUndefined" not in out and "(required)" in out
    assert "PROJECT-pipeline" in out  # the model `make run` registers


def test_cli_names_an_unreadable_image_and_exits_2(tmp_path):
    from PIL import Image

    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        for i in range(4):
            Image.new("L", (8, 8), i * 40).save(tmp_path / name / f"{i}.png")
    (tmp_path / "b" / "broken.jpg").write_bytes(b"not a jpeg")
    done = subprocess.run([sys.executable, "-m", "flows", "train", "--profile", "smoke",
                           "--data", str(tmp_path), "--image-size", "8"], cwd=ROOT,
                          env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert f"error: cannot read image {tmp_path / 'b' / 'broken.jpg'}" in done.stderr
    assert "Traceback" not in done.stderr  # the log names the error, without a traceback


def test_a_folder_without_class_folders_stops_before_the_flow_starts(tmp_path, capsys):
    (tmp_path / "only").mkdir()
    with pytest.raises(SystemExit) as stop:
        main(COMMANDS, ["train", "--data", str(tmp_path)])
    assert stop.value.code == 2
    assert capsys.readouterr().err == ("error: invalid configuration:\n  data: "
                                       f"{tmp_path} needs at least 2 class sub-folders, found 1 "
                                       f"(got '{tmp_path}')\n")


def test_a_prefect_server_that_does_not_start_in_time_ends_in_one_error_line(tmp_path):
    # no API URL: the flow starts Prefect's temporary server, given 0 s to answer
    env = {key: value for key, value in os.environ.items() if key != "PREFECT_API_URL"}
    env |= {"PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "0",
            "PREFECT_HOME": str(tmp_path / "prefect")}
    done = subprocess.run([sys.executable, "-m", "flows", "train", "--profile", "smoke"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS" in errors[0]
    assert "Traceback" not in done.stderr


def test_each_sparsify_task_has_its_defaults_below_the_profile_and_the_given_values():
    from tasks.configs.sparsify import SparsifyConfig

    classification = SparsifyConfig()  # one lambda for both maps (bench.area_rule)
    assert (classification.sparsity_lambda, classification.lambda_gamma) == (0.42, 0.0)
    assert SparsifyConfig(lambda_gamma=0.5).lambda_gamma == 0.5
    contour = SparsifyConfig(task="contour")
    assert (contour.sparsity_lambda, contour.optim.batch_size, contour.rounds) == (0.02, 16, 6)
    assert SparsifyConfig(task="contour", sparsity_lambda=0.3).sparsity_lambda == 0.3
    assert SparsifyConfig(task="detection").sparsity_lambda == 0.3
    assert SparsifyConfig(task="contour", profile="smoke").layouts == (64, 32, 32)


def test_every_flow_takes_no_register():
    from flows.cli import make_parser

    for command in ("train", "distill", "pbt", "sparsify", "cascade", "image-text", "pipeline"):
        parser, _ = make_parser(COMMANDS, command)
        assert parser.parse_args([command, "--no-register"]).registry is False
        assert parser.parse_args([command, "--no-registry"]).registry is False
        assert "registry" not in vars(parser.parse_args([command]))  # the profile decides
