"""The control plane between the console and agents: messages, the agent client, the hub, enrolment, links."""
