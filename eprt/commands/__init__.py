"""The command-line tools, installed as console scripts (setup.py's entry points): eprt-convert,
eprt-ptq, eprt-export, eprt-check, eprt-make-tiny. Each module's `main()` runs one under
`eprt.cli.run`; `python -m eprt.commands.NAME` (and `torchrun -m eprt.commands.ptq`) runs it too."""
