"""The contract every part of livetune shares, and nothing else: torch-free, imports nothing of ours.

    config.py         the run config schema (one typed declaration feeds every front end)
    presets.py        named starting configs, and the embedded default's measured hyperparameters
    protocol.py       the control protocol: commands, run states, events, wire format
    run_folder.py     a run's folder, its event log writer and its one tailer
    layout_checks.py  which parallel layouts a config and its model allow, read from files
"""
