"""Greedy tokens of a model loaded back from the MLflow registry or from an export directory:
what the registry tests (tests/stages/test_registry.py, tests/e2e/test_tracking_e2e.py) compare."""
from __future__ import annotations

PROMPT = "the happy dog"


def greedy_tokens(model, tokenizer, prompt: str = PROMPT, n: int = 8) -> list[int]:
    import torch

    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, ids.shape[1]:].tolist()


def registered_greedy(uri: str, name: str, version) -> list[int]:
    """Greedy tokens of registered model `name` version `version`, loaded back through MLflow's
    transformers flavour from the server at `uri`."""
    import mlflow
    import mlflow.transformers

    mlflow.set_tracking_uri(uri)
    try:
        parts = mlflow.transformers.load_model(f"models:/{name}/{version}",
                                               return_type="components")
    finally:
        mlflow.set_tracking_uri(None)
    return greedy_tokens(parts["model"], parts["tokenizer"])


def export_greedy(path) -> list[int]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return greedy_tokens(AutoModelForCausalLM.from_pretrained(path),
                         AutoTokenizer.from_pretrained(path))
