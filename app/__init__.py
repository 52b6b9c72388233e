"""The front ends (Gradio app, notebook widgets) and what they share: the run manager
(`supervisor`) and the control client (`supervisor.client`).

Kept import-light on purpose: importing `app` loads nothing, so a script that only wants
`supervisor` or `supervisor.client` never pays for Gradio, and nothing under app/ imports torch or
deepspeed.
"""
