"""proxy: the OpenAI front door over pools of prefill and decode workers; each request goes
through one P and one D (pull or push) or D alone. See docs/design.md."""
