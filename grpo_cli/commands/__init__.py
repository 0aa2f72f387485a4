"""The commands: each a function that takes a dataset and a config and returns a result object; none prints.

:mod:`grpo_cli.render` turns results into text, JSON, CSV and HTML; :mod:`grpo_cli.cli` wires options to both.
"""
