"""The front ends, and the two pieces they share so they cannot drift apart:

    form.py      the run config form as data (fields from the contract's schema, form values <->
                 RunConfig with every problem by field, presets, YAML): the web app's Configure
                 tab and the notebook's ConfigForm both lay out this one form
    session.py   the session object: which runs there are, the current one, start / attach /
                 typed commands / chat / stop, on supervisor.RunManager and supervisor.client.RunClient;
                 the web backend and the notebook's Run both drive it, so the commands a state
                 allows and what Stop means (the contract's Stop default) are the same everywhere
    series.py    a run's event log folded into plot series (web plots and notebook plots)
    web/         the Gradio app: one module per tab, and backend/ (one object per job)
    notebook/    ipywidgets: the run panel, the config form widgets, the chat box, plain calls
    cli.py       the terminal front end (`./launch.sh train`)

Kept import-light on purpose: importing `app` loads nothing, so a script that only wants the
supervisor never pays for Gradio; nothing under app/ imports torch or deepspeed.
"""
