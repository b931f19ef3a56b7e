"""``pb_utils.ModelConfig``: what ``auto_complete_config`` receives and may change.

Only max_batch_size, the scheduler choice (dynamic batching), inputs, outputs and the
transaction policy may be set, and only in ways that agree with an explicit config.
"""
from __future__ import annotations

import json
from typing import Any


class ModelConfig:
    """The model configuration (Triton's JSON form as a dict) during auto-complete."""

    def __init__(self, model_config: str | dict) -> None:
        cfg = json.loads(model_config) if isinstance(model_config, str) else dict(model_config)
        cfg.setdefault("max_batch_size", 0)
        cfg.setdefault("input", [])
        cfg.setdefault("output", [])
        cfg.setdefault("name", "")
        self._model_config = cfg

    def as_dict(self) -> dict:
        return self._model_config

    def _name(self) -> str:
        return str(self._model_config.get("name", ""))

    def set_max_batch_size(self, max_batch_size: int) -> None:
        cur = int(self._model_config.get("max_batch_size", 0))
        if cur > max_batch_size:
            raise ValueError(
                f"configuration specified max_batch_size {cur}, but in auto-complete-config "
                f"function for model '{self._name()}' specified max_batch_size {max_batch_size}"
            )
        self._model_config["max_batch_size"] = max_batch_size

    def set_dynamic_batching(self) -> None:
        for other in ("sequence_batching", "ensemble_scheduling"):
            if other in self._model_config:
                raise ValueError(
                    f"Configuration specified scheduling_choice as '{other}', but "
                    f"auto-complete-config function for model '{self._name()}' tries to set "
                    "scheduling_choice as 'dynamic_batching'"
                )
        self._model_config.setdefault("dynamic_batching", {})

    def _add_tensor(self, kind: str, tensor: dict, allowed: tuple[str, ...]) -> None:
        if not isinstance(tensor, dict):
            raise TypeError(f"{kind} must be a dict, got {type(tensor).__name__}")
        name = tensor.get("name")
        # Triton's words (measured): "'name', 'data_type', 'dims' and 'optional'", and a tensor
        # without a name is "input in ...", not "input 'None' in ...".
        which = f"{kind} '{name}'" if "name" in tensor else kind
        extra = [k for k in tensor if k not in allowed]
        if extra:
            props = ", ".join(repr(a) for a in allowed[:-1]) + f" and {allowed[-1]!r}"
            raise ValueError(
                f"{which} in auto-complete-config function for model '{self._name()}' "
                f"contains property other than {props}."
            )
        for prop in ("name", "data_type", "dims"):
            if prop not in tensor:
                raise ValueError(
                    f"{which} in auto-complete-config function for model "
                    f"'{self._name()}' is missing '{prop}' property."
                )
        key = "input" if kind == "input" else "output"
        for cur in self._model_config[key]:
            if cur.get("name") != name:
                continue
            cur_type = cur.get("data_type", "TYPE_INVALID")
            if cur_type not in ("TYPE_INVALID", tensor["data_type"]):
                raise ValueError(
                    f"unable to load model '{self._name()}', configuration expects datatype "
                    f"{cur_type} for {kind} '{name}', model provides {tensor['data_type']}"
                )
            if cur.get("dims") and list(cur["dims"]) != list(tensor["dims"]):
                raise ValueError(
                    f"model '{self._name()}', tensor '{name}': the model expects dims "
                    f"{list(tensor['dims'])} but the model configuration specifies dims "
                    f"{list(cur['dims'])}"
                )
            if ("optional" in cur and "optional" in tensor
                    and cur["optional"] != tensor["optional"]):
                raise ValueError(
                    f"model '{self._name()}', tensor '{name}': the model expects optional "
                    f"{tensor['optional']} but the model configuration specifies optional "
                    f"{cur['optional']}"
                )
            cur["data_type"] = tensor["data_type"]
            cur["dims"] = list(tensor["dims"])
            if "optional" in tensor:
                cur["optional"] = tensor["optional"]
            return
        self._model_config[key].append(dict(tensor))

    def add_input(self, input: dict) -> None:  # noqa: A002 - Triton's parameter name
        self._add_tensor("input", input, ("name", "data_type", "dims", "optional"))

    def add_output(self, output: dict) -> None:
        self._add_tensor("output", output, ("name", "data_type", "dims"))

    def set_model_transaction_policy(self, transaction_policy_dict: dict[str, Any]) -> None:
        extra = [k for k in transaction_policy_dict if k != "decoupled"]
        if extra:
            raise ValueError(
                f"model transaction property in auto-complete-config function for model "
                f"'{self._name()}' contains property other than 'decoupled'."
            )
        policy = self._model_config.setdefault("model_transaction_policy", {})
        if "decoupled" in transaction_policy_dict:
            want = bool(transaction_policy_dict["decoupled"])
            if "decoupled" in policy and bool(policy["decoupled"]) != want:
                raise ValueError(
                    f"trying to change decoupled property in auto-complete-config for model "
                    f"'{self._name()}', which is already set to '{policy['decoupled']}'."
                )
            policy["decoupled"] = want
