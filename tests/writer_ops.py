"""How the scenario builds the writer's operations (today: tuples)."""


class OPS:
    start = staticmethod(lambda flight: ("start", flight))
    outputs = staticmethod(lambda outs, at: ("outputs", outs, at))
    end = staticmethod(lambda flight, terminal: ("end", flight, terminal))
    publish = staticmethod(lambda channel, data: ("publish", channel, data))
    command = staticmethod(lambda *args: args)
