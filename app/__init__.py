"""The front ends (Gradio app, notebook widgets) and what they share: the run manager
(`app.runs`) and the control client (`app.client`).

Kept import-light on purpose: importing `app` loads nothing, so a script that only wants
`app.runs` or `app.client` never pays for Gradio, and nothing under app/ imports torch or
deepspeed.
"""
