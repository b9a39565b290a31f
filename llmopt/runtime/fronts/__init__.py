"""Engine fronts: what a command or the server drives. Each is an EngineClient (client.py): one Engine in this
process, the data-parallel front over replica processes, or the disaggregated front over prefill and decode
worker processes; create.create_engine picks one from the engine config."""
