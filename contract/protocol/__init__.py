"""The command/event protocol between front ends and rank 0; torch-free, both sides import it.

commands: the run commands and parsing a message; base: what every command is made of;
branch_commands, data_commands, completion_commands: the rest of the commands; states: RunState;
wire: bytes on the socket. The events are declared in contract.events."""
