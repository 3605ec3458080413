"""A request's journey through the workers, one module per stage (docs/design.md, "A request's
path" and "Migration"):

- `plan.py`: which D decodes, and whether P computes the prompt first (push or pull) or D alone;
  one plan for a new request and for every move of one.
- `prefill.py`: the proxy's side of a prompt computed on P: the prefill call, the push
  reservation on D, the prefix D lends P (the reverse pull), and giving back what a request
  will not read.
- `decode.py`: the call to D (another D when one cannot be reached), and a whole answer.
- `relay.py`: D's events to the client, through `client.py`'s record of what the client has.
- `migration.py`: a failed D's choices continue on another, planned and prefilled as a new
  request's would be.

`calls.py` is how every stage calls a worker. proxy/orchestrator.py composes the stages.
"""
