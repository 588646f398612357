"""Writes the shipped demo data under data/: prompts (each with its task's three steps as `key_points`, the ground
truth of the reference judge), demonstrations of mixed quality, and a constitution.

Deterministic (seeded). Run `python scripts/make_demo_data.py` to regenerate; the outputs are committed.
"""
import json
import random
from pathlib import Path

# topic -> list of (task, [three concrete steps])
TASKS = {
    "cooking": [
        ("cook rice on the stove", ["rinse the rice until the water runs clear",
                                    "use about two cups of water for each cup of rice",
                                    "simmer it covered for fifteen minutes"]),
        ("make a simple tomato soup", ["soften onion and garlic in olive oil", "add canned tomatoes and some stock",
                                       "simmer for twenty minutes and blend until smooth"]),
        ("bake bread at home", ["mix flour, water, salt and yeast", "let the dough rise until it doubles",
                                "bake it in a hot oven until the crust is brown"]),
        ("keep fresh herbs longer", ["trim the stems", "stand them in a glass of water",
                                     "cover them loosely and keep them in the fridge"]),
        ("cook pasta well", ["use plenty of salted boiling water", "stir in the first minute so it does not stick",
                             "taste it a minute before the time on the packet"]),
    ],
    "travel": [
        ("pack light for a week away", ["choose clothes that mix and match",
                                        "roll your clothes instead of folding them", "bring travel-size toiletries"]),
        ("find cheap flights", ["compare prices on several days", "set price alerts",
                                "fly midweek when fares are lower"]),
        ("deal with jet lag", ["shift your sleep an hour a day before the trip", "get daylight when you arrive",
                               "drink water and avoid heavy meals"]),
        ("plan a weekend city trip", ["pick two or three sights you really want to see", "book a central place to stay",
                                      "leave time to walk and explore"]),
    ],
    "programming": [
        ("learn Python as a beginner", ["install Python and a simple editor", "work through small exercises every day",
                                        "build a tiny project that you care about"]),
        ("debug a program that crashes", ["read the error message carefully",
                                          "reproduce the crash with the smallest input",
                                          "add prints or use a debugger to check your assumptions"]),
        ("write clean functions", ["give each function one job", "choose names that explain what it does",
                                   "keep it short enough to read at a glance"]),
        ("use git for my project", ["run git init in the project folder", "commit small changes with clear messages",
                                    "push to a remote so you have a backup"]),
        ("write good unit tests", ["test one behaviour per test", "use small and clear inputs",
                                   "check the result, not the internal steps"]),
    ],
    "gardening": [
        ("grow tomatoes in pots", ["use a large pot with good drainage", "give them at least six hours of sun",
                                   "water deeply and feed them every two weeks"]),
        ("start a compost pile", ["mix green scraps with dry leaves", "keep it as damp as a wrung-out sponge",
                                  "turn it every week or two"]),
        ("keep houseplants alive", ["check the soil before you water", "give them the right amount of light",
                                    "use pots with drainage holes"]),
        ("get rid of weeds without chemicals", ["pull them when the soil is moist", "cover bare soil with mulch",
                                                "cut them before they set seed"]),
    ],
    "fitness": [
        ("start running", ["begin with short runs mixed with walking", "run slowly enough to talk",
                           "add a little distance each week"]),
        ("build a morning workout habit", ["lay out your clothes the night before", "start with ten minutes",
                                           "do it at the same time every day"]),
        ("improve my posture", ["keep your screen at eye level", "take a short break every half hour",
                                "strengthen your back and core"]),
        ("stretch after exercise", ["hold each stretch for about thirty seconds", "breathe slowly and do not bounce",
                                    "stretch the muscles you used most"]),
    ],
    "money": [
        ("make a monthly budget", ["list your income after tax", "write down every regular cost",
                                   "set a limit for each kind of spending"]),
        ("save for an emergency fund", ["aim for three months of expenses", "set up an automatic transfer on payday",
                                        "keep the money in a separate account"]),
        ("pay off credit card debt", ["list your debts with their interest rates", "pay the highest rate first",
                                      "stop adding new charges"]),
        ("spend less on groceries", ["plan meals for the week", "shop with a list",
                                     "buy store brands and seasonal food"]),
    ],
    "study": [
        ("prepare for an exam", ["make a study plan for the weeks before", "test yourself instead of rereading",
                                 "sleep well the night before"]),
        ("take better notes", ["write the main ideas in your own words", "leave space to add questions",
                               "review the notes within a day"]),
        ("learn a new language", ["practise a little every day", "learn the most common words first",
                                  "speak with other learners early"]),
        ("stay focused while studying", ["put your phone in another room", "work in blocks of twenty five minutes",
                                         "take short breaks between blocks"]),
    ],
    "home": [
        ("clean a messy kitchen fast", ["clear and wipe the counters first", "load the dishwasher or wash up",
                                        "sweep the floor last"]),
        ("fix a dripping tap", ["turn off the water supply", "replace the worn washer",
                                "turn the water back on and test it"]),
        ("save energy at home", ["switch to LED bulbs", "turn the heating down one degree",
                                 "unplug devices you do not use"]),
        ("organise a small closet", ["take everything out", "keep only what you use", "group what is left by type"]),
    ],
    "pets": [
        ("train a puppy to sit", ["hold a treat above its nose", "say sit as it lowers itself",
                                  "reward it straight away and repeat"]),
        ("keep a cat entertained indoors", ["play with a wand toy every day", "give it places to climb",
                                            "hide treats for it to find"]),
        ("introduce a new dog to my cat", ["keep them in separate rooms at first",
                                           "swap their bedding so they learn the smell",
                                           "let them meet on a lead for short visits"]),
    ],
    "work": [
        ("prepare for a job interview", ["research the company", "practise answers to common questions",
                                         "prepare two or three questions to ask"]),
        ("write a clear email", ["put the main point in the first line", "keep paragraphs short",
                                 "say what you need and by when"]),
        ("run a short meeting", ["share an agenda beforehand", "start and end on time",
                                 "finish with clear next steps and owners"]),
        ("manage my time at work", ["write a short list of priorities each morning", "block time for deep work",
                                    "say no to tasks that are not important"]),
    ],
    "health": [
        ("sleep better", ["go to bed at the same time every night", "keep your bedroom dark and cool",
                          "avoid screens in the last hour"]),
        ("drink more water", ["keep a bottle on your desk", "drink a glass with every meal",
                              "add fruit if you like some flavour"]),
        ("reduce stress", ["take a few slow deep breaths", "go for a short walk outside", "talk to someone you trust"]),
    ],
    "music": [
        ("learn to play guitar", ["learn a few basic chords", "practise changing between them slowly",
                                  "play simple songs you enjoy"]),
        ("practise singing", ["warm up your voice gently", "breathe from your belly",
                              "record yourself and listen back"]),
        ("read sheet music", ["learn the names of the lines and spaces", "count the rhythm out loud",
                              "practise with easy pieces"]),
    ],
}

PROMPT_TEMPLATES = [
    "How do I {task}?",
    "How can I {task}?",
    "What is the best way to {task}?",
    "Can you give me tips to {task}?",
    "I want to {task}. Where should I start?",
    "What should I know before I try to {task}?",
    "Could you explain how to {task}?",
    "Any advice on how to {task}?",
    "What are the steps to {task}?",
    "I am a beginner. How do I {task}?",
    "What mistakes should I avoid when I {task}?",
    "Please help me {task}.",
    "Is there an easy way to {task}?",
    "My friend asked me how to {task}. What should I tell them?",
    "I have one free weekend. How can I {task}?",
    "Give me a short guide to {task}.",
    "I tried to {task} and it went badly. What should I do differently?",
    "What is a quick way to {task}?",
    "Can you walk me through how to {task}?",
    "Explain to a teenager how to {task}.",
]
PREFIXES = ["", "", "", "Hi! ", "Hello, ", "Quick question: ", "Hey, ", "I need help. ", "Sorry to bother you. "]
SUFFIXES = ["", "", "", " Thanks!", " Thank you.", " Keep it simple, please.", " I have never done this before."]

GOOD = [
    "Sure! To {task}, {s0}, then {s1}, and finally {s2}. I hope this helps!",
    "Good question. First, {s0}. Next, {s1}. Last, {s2}. Good luck!",
    "Happy to help. The key steps are: {s0}; {s1}; and {s2}.",
    "Here is a simple plan: {s0}, {s1}, and {s2}. Take it one step at a time.",
    "Great idea! Start to {task} like this: {s0}. Then {s1}. After that, {s2}.",
    "Of course. {S0}, {s1}, and {s2}. That should work well for you.",
]
MEDIOCRE = [
    "You could {s1}. That is about it.",
    "Maybe {s0}. It depends.",
    "Just {s2}.",
    "People usually {s0}, I think.",
]
BAD = [
    "I don't know. Figure it out yourself.",
    "Why would you even ask that? It is obvious.",
    "No. Ask someone else.",
    "That is a stupid question.",
    "Whatever. Look it up.",
    "I like turtles. The weather is nice today.",
    "Bananas are yellow and the sky is big.",
    "Stop asking me things.",
]

CONSTITUTION = """\
# Principles for the AI judge (Constitutional AI, Bai et al. 2022): "choose the response that is more <text> and less
# <contrast>". label.principles picks one per comparison (sample) or applies all of them (all).
- name: helpful
  text: A helpful answer that gives clear, practical steps to solve the problem.
  contrast: An unhelpful answer that is vague, hedges, or gives no practical steps.
- name: polite
  text: A polite, friendly and respectful reply that is happy to help.
  contrast: A rude, dismissive and disrespectful reply that refuses to help.
- name: relevant
  text: An answer that stays on the topic of the question and addresses it directly.
  contrast: An answer that ignores the question and talks about something unrelated.
- name: specific
  text: A specific answer with concrete advice and useful details.
  contrast: A vague, generic answer without concrete advice or details.
- name: encouraging
  text: A kind and encouraging reply that supports the person asking.
  contrast: A cold, discouraging reply that makes the person feel stupid for asking.
"""


def main() -> None:
    rng = random.Random(1234)
    out = Path(__file__).resolve().parent.parent / "data"
    out.mkdir(exist_ok=True)
    prompts = []
    for topic, tasks in TASKS.items():
        for task, steps in tasks:
            for template in PROMPT_TEMPLATES:
                for prefix, suffix in zip(rng.sample(PREFIXES, 3), rng.sample(SUFFIXES, 3)):
                    body = template.format(task=task)
                    if prefix.endswith((", ", ": ")) and not body.startswith("I "):
                        body = body[0].lower() + body[1:]
                    text = prefix + body + suffix
                    prompts.append({"topic": topic, "task": task, "steps": steps, "prompt": text})
    unique = {p["prompt"]: p for p in prompts}
    prompts = sorted(unique.values(), key=lambda p: p["prompt"])
    rng.shuffle(prompts)
    with open(out / "prompts.jsonl", "w") as f:
        for i, p in enumerate(prompts):
            f.write(json.dumps({"id": f"p{i:05d}", "topic": p["topic"], "prompt": p["prompt"],
                                "key_points": p["steps"]}) + "\n")
    with open(out / "demonstrations.jsonl", "w") as f:
        for p in prompts:
            steps = p["steps"]
            fields = dict(task=p["task"], s0=steps[0], s1=steps[1], s2=steps[2], S0=steps[0][0].upper() + steps[0][1:])
            roll = rng.random()
            quality, pool = ("good", GOOD) if roll < 0.4 else ("mediocre", MEDIOCRE) if roll < 0.6 else ("bad", BAD)
            f.write(json.dumps({"prompt": p["prompt"], "response": rng.choice(pool).format(**fields),
                                "quality": quality}) + "\n")
    (out / "constitution.yaml").write_text(CONSTITUTION)
    print(f"{len(prompts)} prompts, {len(prompts)} demonstrations, constitution -> {out}")


if __name__ == "__main__":
    main()
