"""Recipes: ordered glob/regex rules, first match wins, keep, defaults, TOML files, stored in the output."""
import json

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from qcore import InputError, SchemeError
from qcore.files import io as qio
from qcore.cli.main import main
from qcore.model.recipe import Recipe, Rule, as_recipe

F32 = np.float32


def choose(recipe, name, shape=(64, 64), dtype=F32):
    d = recipe.choose(name, shape, dtype)
    return str(d.scheme) if d.scheme is not None else d.reason


def test_first_matching_rule_wins_and_keep():
    r = as_recipe("q8s", rules=["*.mlp.*=q4s/block32:f16", "re:^layers\\.1\\.=nvfp4", "*lm_head*=keep"])
    assert choose(r, "layers.0.mlp.up.weight") == "q4s/block32:f16"
    assert choose(r, "layers.1.mlp.up.weight") == "q4s/block32:f16"  # the glob comes first
    assert choose(r, "layers.1.attn.weight") == str(as_recipe("nvfp4").scheme)  # regex, searched
    assert choose(r, "lm_head.weight") == "kept: matches rule '*lm_head*'=keep"
    assert choose(r, "layers.2.attn.weight") == "q8s"  # no rule: the default scheme


def test_defaults_keep_1d_small_non_float_embeddings_and_norms():
    r = Recipe("q8s", min_size=100)
    assert choose(r, "bias", (64,)).startswith("kept: 1-D")
    assert choose(r, "w", (4, 4)) == "kept: 16 elements < --min-size 100"
    assert choose(r, "ids", (4, 64), np.int64) == "kept: int64 is not a float dtype"
    assert "default keep '*embed*'" in choose(r, "model.embed_tokens.weight")
    assert "default keep '*norm*'" in choose(r, "layers.0.post_attention_layernorm.weight")
    assert choose(r, "w", (64, 64), ml_dtypes.bfloat16) == "q8s"
    # asked for: a rule names embeddings, include_1d takes 1-D tensors
    asked = Recipe("q8s", (Rule.parse("*embed*=q8s"),), include_1d=True)
    assert choose(asked, "model.embed_tokens.weight") == "q8s"
    assert choose(asked, "bias", (64,)) == "q8s"


def test_no_default_scheme_keeps_unmatched():
    r = as_recipe(None, rules=["*.mlp.*=q8s"])
    assert choose(r, "a.mlp.w") == "q8s"
    assert choose(r, "a.attn.w") == "kept: no rule matches and the recipe has no default scheme"


@pytest.mark.parametrize("text,err,match", [
    ("no-equals-sign", InputError, "a rule is PATTERN=SCHEME"),
    ("*=q9s", SchemeError, r"rule '\*=q9s'"),
    ("re:([=q8s", InputError, "not a valid regular expression"),
])
def test_bad_rules_are_clear_errors(text, err, match):
    with pytest.raises(err, match=match):
        Rule.parse(text)


def test_toml_recipe_round_trips_through_json(tmp_path):
    f = tmp_path / "r.toml"
    f.write_text('scheme = "q8s"\ninclude_1d = true\nmin_size = 10\n'
                 '[[rule]]\npattern = "*.mlp.*"\nscheme = "q4s/block32:f16"\n'
                 '[[rule]]\npattern = "re:^lm_head"\nscheme = "keep"\n')
    r = Recipe.from_toml(f)
    assert [(x.pattern, x.scheme_text) for x in r.rules] == [("*.mlp.*", "q4s/block32:f16"), ("re:^lm_head", "keep")]
    assert r.include_1d and r.min_size == 10 and str(r.scheme) == "q8s"
    assert Recipe.from_json(r.to_json()) == r
    assert as_recipe(str(f)) == r
    (tmp_path / "bad.toml").write_text('scheme = "q8s"\nshceme = 1\n')
    with pytest.raises(InputError, match="unknown recipe key 'shceme'"):
        Recipe.from_toml(tmp_path / "bad.toml")
    (tmp_path / "broken.toml").write_text('scheme = \n')
    with pytest.raises(InputError, match="is not valid TOML"):
        Recipe.from_toml(tmp_path / "broken.toml")


def test_cli_rules_and_recipe_file_stored_and_shown(tmp_path, capsys):
    rng = np.random.default_rng(0)
    save_file({"layers.0.mlp.weight": rng.standard_normal((8, 64)).astype(F32),
               "layers.0.attn.weight": rng.standard_normal((8, 64)).astype(F32),
               "lm_head.weight": rng.standard_normal((8, 64)).astype(F32)}, str(tmp_path / "m.safetensors"))
    (tmp_path / "r.toml").write_text('scheme = "q8s"\n[[rule]]\npattern = "*.mlp.*"\nscheme = "q4s/block32:f16"\n')
    rc = main(["quantize", str(tmp_path / "m.safetensors"), str(tmp_path / "q.safetensors"), "--recipe",
               str(tmp_path / "r.toml"), "--rule", "re:^lm_head=keep", "--backend", "reference"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "recipe: re:^lm_head=keep, *.mlp.*=q4s/block32:f16, default=q8s" in out
    info = qio.read_info(tmp_path / "q.safetensors")
    kinds = {e.name: str(e.scheme) if e.quantized else e.dtype for e in info.entries}
    assert kinds == {"layers.0.mlp.weight": "q4s/block32:f16", "layers.0.attn.weight": "q8s", "lm_head.weight": "F32"}
    assert json.loads(info.recipe)["rules"] == [["re:^lm_head", "keep"], ["*.mlp.*", "q4s/block32:f16"]]
    rc = main(["inspect", str(tmp_path / "q.safetensors")])
    out, _ = capsys.readouterr()
    assert rc == 0 and "recipe: re:^lm_head=keep, *.mlp.*=q4s/block32:f16, default=q8s" in out


def test_cli_needs_a_scheme(tmp_path, capsys):
    save_file({"w": np.zeros((2, 32), F32)}, str(tmp_path / "m.safetensors"))
    rc = main(["quantize", str(tmp_path / "m.safetensors"), str(tmp_path / "q.safetensors")])
    assert rc == 2
    assert "give a scheme: --scheme SCHEME, --rule PATTERN=SCHEME or --recipe FILE.toml" in capsys.readouterr()[1]
