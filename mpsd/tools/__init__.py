"""Operator tools: `validate` and `init-model` work on files, `infer` and `models` ask a daemon."""
