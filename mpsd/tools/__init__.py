"""What the operator commands do: `validate`, `init-model` and `convert-config` work on files; `infer`,
`models` and `ops` (status, logs, health, reload) ask a daemon. Their arguments are parsed in mpsd.cli."""
