"""Every output: Rich tables, JSON and CSV documents, terminal charts, the HTML report, JUnit and GitHub output.

Pure functions of result objects; the only layer that formats for people (terminal handling — ``NO_COLOR``, TTY,
width — is :func:`grpo_cli.render.console.make_console`). Submodules are imported on use: this package imports
nothing heavy.
"""
