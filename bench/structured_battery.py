"""The validity battery of structured outputs (issue 28 item 5): JSON schemas of increasing
difficulty, each with the request a user would send, plus regex and choice cases.

Levels: 1 flat scalars; 2 required/optional, enums, bounds; 3 nested objects, arrays with bounds;
4 anyOf / nullable, patterns, formats, $defs; 5 shapes of public schema benchmarks (JSONSchemaBench's
GitHub/Glaive/Kubernetes-style configs, function-call arguments, API payloads). Then a tool-call
battery: six tools (no arguments, enums, bounds, patterns, formats, anyOf, a closed object) and
requests that fit one of them. Used by bench/structured.py (compile times, speed),
bench/structured_validity.py (validity through HTTP) and tests/bench/test_structured_battery.py.
"""

from __future__ import annotations

S, I, N, B = {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}


def obj(properties: dict, required: list[str] | None = None, **more) -> dict:
    """An object schema; every property required unless `required` says otherwise."""
    return {"type": "object", "properties": properties,
            "required": list(properties) if required is None else required, **more}


def arr(items: dict, **bounds) -> dict:
    return {"type": "array", "items": items, **bounds}


ADDRESS = obj({"street": S, "city": S, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}})
SCHEMAS: list[tuple[str, dict, str]] = [  # (name, schema, what the user asks for)
    # level 1: flat scalars
    ("name", obj({"name": S}), "Give the name of a famous scientist."),
    ("age", obj({"age": I}), "How old is a typical university student?"),
    ("price", obj({"price": N}), "What does a cup of coffee cost in dollars?"),
    ("flag", obj({"is_capital": B}), "Is Paris the capital of France?"),
    ("pair", obj({"city": S, "country": S}), "Name a city and its country."),
    ("person", obj({"name": S, "age": I}), "Describe a person with a name and an age."),
    ("book", obj({"title": S, "author": S, "year": I}), "Describe a classic novel."),
    ("point", obj({"x": N, "y": N}), "Give a point in the plane."),
    ("weather", obj({"city": S, "temperature_c": N, "sunny": B}), "Report the weather in Rome."),
    ("product", obj({"sku": S, "name": S, "price": N, "in_stock": B}), "Describe a product in a shop."),
    # level 2: required / optional, enums, bounds, additionalProperties
    ("optional", obj({"name": S, "nickname": S}, required=["name"]), "Describe a dog."),
    ("enum", obj({"color": {"enum": ["red", "green", "blue"]}}), "Pick a primary colour of light."),
    ("enum2", obj({"size": {"enum": ["S", "M", "L", "XL"]}, "qty": I}), "Order a t-shirt."),
    ("bounded_int", obj({"rating": {"type": "integer", "minimum": 1, "maximum": 5}}), "Rate a movie you like."),
    ("bounded_num", obj({"probability": {"type": "number", "minimum": 0, "maximum": 1}}), "How likely is rain?"),
    ("strlen", obj({"code": {"type": "string", "minLength": 3, "maxLength": 6}}), "Give an airport code."),
    ("closed", obj({"a": I, "b": I}, additionalProperties=False), "Two numbers that add up to ten."),
    ("const", obj({"version": {"const": "1.0"}, "name": S}), "Describe a software release."),
    ("exclusive", obj({"t": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 100}}),
     "A temperature in Celsius between 0 and 100."),
    ("multi_enum", obj({"day": {"enum": ["mon", "tue", "wed", "thu", "fri", "sat", "sun"]}, "busy": B}),
     "Which day are you busiest?"),
    # level 3: nested objects, arrays with bounds
    ("tags", obj({"tags": arr(S, minItems=1, maxItems=4)}), "Tag a blog post about cooking."),
    ("numbers", obj({"primes": arr(I, minItems=3, maxItems=3)}), "List three prime numbers."),
    ("address", obj({"name": S, "address": ADDRESS}), "Give the address of a company."),
    ("nested2", obj({"user": obj({"id": I, "profile": obj({"bio": S, "public": B})})}), "Create a user profile."),
    ("list_obj", obj({"items": arr(obj({"name": S, "qty": I}), minItems=1, maxItems=3)}), "A short shopping list."),
    ("matrix", obj({"rows": arr(arr(I, minItems=2, maxItems=2), minItems=2, maxItems=2)}), "A 2x2 matrix."),
    ("unique", obj({"ids": arr(I, minItems=2, maxItems=4, uniqueItems=True)}), "A few distinct ids."),
    ("empty_ok", obj({"notes": arr(S, maxItems=2)}), "Notes about a meeting (maybe none)."),
    ("recipe", obj({"title": S, "ingredients": arr(obj({"item": S, "grams": I}), minItems=2, maxItems=4),
                    "steps": arr(S, minItems=1, maxItems=3)}), "A simple pancake recipe."),
    ("team", obj({"team": S, "members": arr(obj({"name": S, "role": {"enum": ["dev", "ops", "pm"]}}),
                                            minItems=2, maxItems=3)}), "Describe a small software team."),
    # level 4: anyOf / nullable, patterns, formats, $defs
    ("nullable", obj({"middle_name": {"type": ["string", "null"]}, "name": S}), "A person's names."),
    ("anyof", obj({"id": {"anyOf": [I, {"type": "string", "pattern": "^[a-z]{3}$"}]}}), "An identifier."),
    ("oneof_shape", obj({"shape": {"anyOf": [obj({"kind": {"const": "circle"}, "r": N}),
                                              obj({"kind": {"const": "square"}, "side": N})]}}), "Describe a shape."),
    ("pattern_phone", obj({"phone": {"type": "string", "pattern": "^\\+[0-9]{2} [0-9]{3} [0-9]{4}$"}}),
     "A phone number."),
    ("pattern_date", obj({"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}}),
     "A date this century."),
    ("format_date", obj({"when": {"type": "string", "format": "date"}}), "When is the next holiday?"),
    ("format_email", obj({"email": {"type": "string", "format": "email"}}), "Give an email address."),
    ("defs", {"type": "object", "$defs": {"pt": obj({"x": I, "y": I})},
              "properties": {"from": {"$ref": "#/$defs/pt"}, "to": {"$ref": "#/$defs/pt"}},
              "required": ["from", "to"]}, "A line segment."),
    ("mixed_array", obj({"values": arr({"anyOf": [I, S, B]}, minItems=2, maxItems=4)}), "A few mixed values."),
    ("enum_numbers", obj({"level": {"enum": [1, 2, 3]}, "label": {"enum": ["low", "mid", "high"]}}),
     "A priority level."),
    # level 5: shapes of public schema benchmarks (JSONSchemaBench subsets, function calling, configs)
    ("github_issue", obj({"title": S, "labels": arr({"enum": ["bug", "feature", "docs"]}, maxItems=2),
                          "assignee": {"type": ["string", "null"]}, "state": {"enum": ["open", "closed"]}}),
     "File a bug report about a crash."),
    ("function_args", obj({"location": S, "unit": {"enum": ["celsius", "fahrenheit"]}, "days": {
        "type": "integer", "minimum": 1, "maximum": 7}}), "Arguments to get a weather forecast for Oslo."),
    ("k8s_container", obj({"name": {"type": "string", "pattern": "^[a-z][a-z0-9-]{1,20}$"}, "image": S,
                           "ports": arr(obj({"containerPort": {"type": "integer", "minimum": 1, "maximum": 65535}}),
                                        maxItems=2),
                           "env": arr(obj({"name": S, "value": S}), maxItems=2)}), "A container for nginx."),
    ("api_payload", obj({"method": {"enum": ["GET", "POST"]}, "path": {"type": "string", "pattern": "^/[a-z/]*$"},
                         "headers": obj({"accept": S}), "body": {"type": ["object", "null"]}},
                        required=["method", "path"]), "An HTTP request to list users."),
    ("invoice", obj({"number": {"type": "string", "pattern": "^INV-[0-9]{4}$"}, "lines": arr(
        obj({"desc": S, "amount": {"type": "number", "minimum": 0}}), minItems=1, maxItems=3),
        "total": {"type": "number", "minimum": 0}, "paid": B}), "An invoice for consulting work."),
    ("event", obj({"name": S, "start": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"},
                   "attendees": arr(obj({"name": S, "rsvp": {"enum": ["yes", "no", "maybe"]}}), maxItems=3),
                   "location": {"anyOf": [ADDRESS, {"type": "null"}]}}), "A team lunch event."),
    ("glaive_tool", obj({"name": {"const": "search_books"}, "arguments": obj(
        {"query": S, "max_results": {"type": "integer", "minimum": 1, "maximum": 10}})}),
     "Call the book search tool for science fiction."),
    ("config", obj({"debug": B, "log_level": {"enum": ["debug", "info", "warn", "error"]},
                    "retries": {"type": "integer", "minimum": 0, "maximum": 5},
                    "servers": arr(obj({"host": S, "port": I}), minItems=1, maxItems=2)}),
     "A service configuration."),
    ("tree", {"type": "object", "$defs": {"node": obj({"value": I, "children": arr({"$ref": "#/$defs/node"},
                                                                                    maxItems=2)})},
              "properties": {"root": {"$ref": "#/$defs/node"}}, "required": ["root"]}, "A small tree of numbers."),
    ("order", obj({"order_id": I, "customer": obj({"name": S, "email": {"type": "string", "format": "email"}}),
                   "items": arr(obj({"sku": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"}, "qty": {
                       "type": "integer", "minimum": 1}}), minItems=1, maxItems=3),
                   "status": {"enum": ["new", "shipped", "delivered"]}}), "An online order."),
    ("survey", obj({"respondent": obj({"age": {"type": "integer", "minimum": 18, "maximum": 99}, "country": S}),
                    "answers": arr(obj({"q": I, "a": {"anyOf": [I, S, B]}}), minItems=2, maxItems=3),
                    "comment": {"type": ["string", "null"], "maxLength": 40}}), "Answers to a short survey."),
]
REGEXES: list[tuple[str, str, str]] = [
    ("iso_date", r"20[0-9]{2}-[01][0-9]-[0-3][0-9]", "What is a date next year?"),
    ("ipv4", r"((25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])\.){3}(25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])",
     "Give an IP address."),
    ("time", r"[0-2][0-9]:[0-5][0-9]", "What time is lunch?"),
    ("word_num", r"[A-Z][a-z]{2,10} [0-9]{1,3}", "A street name and a number."),
    ("hex_color", r"#[0-9a-f]{6}", "A colour as hex."),
]
CHOICES: list[tuple[str, list[str], str]] = [
    ("yes_no", ["yes", "no"], "Is water wet?"),
    ("sentiment", ["positive", "negative", "neutral"], "Sentiment of: 'I love this film!'"),
    ("planet", ["Mercury", "Venus", "Earth", "Mars"], "Which planet do we live on?"),
]


# ------------------------------------------------------------------------------ tool calls

def tool(name: str, description: str, parameters: dict | None = None) -> dict:
    """An OpenAI function tool; without parameters it takes no arguments."""
    function = {"name": name, "description": description}
    return {"type": "function", "function": function | ({"parameters": parameters} if parameters else {})}


TOOLS: list[dict] = [
    tool("get_weather", "The current weather in a city.",
         obj({"city": S, "unit": {"enum": ["celsius", "fahrenheit"]}}, required=["city"])),
    tool("get_time", "The current time (no arguments)."),
    tool("search_books", "Search a library catalogue.",
         obj({"query": {"type": "string", "minLength": 2}, "max_results": {"type": "integer", "minimum": 1,
                                                                           "maximum": 10}}, required=["query"])),
    tool("create_event", "Put an event in the calendar.",
         obj({"title": S, "date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"},
              "attendees": arr({"type": "string", "format": "email"}, maxItems=3),
              "reminder": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 120}, {"type": "null"}]}},
             required=["title", "date"], additionalProperties=False)),
    tool("convert_units", "Convert a quantity between units.",
         obj({"value": N, "from_unit": {"enum": ["km", "mi", "kg", "lb"]}, "to_unit": {"enum": ["km", "mi", "kg", "lb"]}})),
    tool("send_message", "Send a chat message to a contact.",
         obj({"to": {"type": "string", "pattern": "^@[a-z]{2,12}$"}, "text": {"type": "string", "maxLength": 80},
              "urgent": B}, required=["to", "text"])),
]
TOOL_CASES: list[tuple[str, str, str]] = [  # (name, the tool that fits, what the user asks)
    ("weather_oslo", "get_weather", "What is the weather in Oslo right now?"),
    ("weather_f", "get_weather", "How warm is it in Miami, in fahrenheit?"),
    ("time_now", "get_time", "What time is it?"),
    ("books_scifi", "search_books", "Find me three science fiction books."),
    ("books_any", "search_books", "Look up books about the history of Rome."),
    ("event_lunch", "create_event", "Add a team lunch on 2027-03-14 with ana@example.com."),
    ("event_dentist", "create_event", "Remind me of the dentist on 2027-01-09, 30 minutes before."),
    ("convert_km", "convert_units", "How many miles is 42 km?"),
    ("convert_lb", "convert_units", "Convert 10 kg to pounds."),
    ("message_bob", "send_message", "Tell @bob that I will be late."),
    ("message_urgent", "send_message", "Urgently message @alice: the server is down."),
    ("two_cities", "get_weather", "What is the weather in Paris and in Rome?"),
]
